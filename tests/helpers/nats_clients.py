"""NATS clients as an attacker or a stage uses them, for the tests of the planes'
permissions: a connection that records the server's permission errors, and the
waits that tell "refused" from "not arrived yet"."""

import asyncio

import nats

from shared.runtime.bus import inbox_prefix

QUIET_S = 0.5  # how long "nothing arrives" is watched, after a flush of both sides


class Client:
    """A NATS connection that records the server's permission errors."""

    def __init__(self) -> None:
        self.nc: nats.NATS | None = None
        self.errors: list[str] = []

    async def connect(self, url: str, user: str | None, password: str | None) -> "Client":
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await asyncio.wait_for(nats.connect(
            url, user=user, password=password, inbox_prefix=inbox_prefix(user), allow_reconnect=False,
            max_reconnect_attempts=0, connect_timeout=2, error_cb=on_error,
        ), 5)
        return self

    async def received(self, subject: str) -> list[nats.aio.msg.Msg]:
        """Subscribe; the list fills as messages arrive."""
        got: list = []

        async def on_msg(msg) -> None:  # noqa: ANN001
            got.append(msg)

        await self.nc.subscribe(subject, cb=on_msg)
        await self.nc.flush()
        return got


async def settle(*clients: Client, until=None) -> None:  # noqa: ANN001
    """Flush every client, wait (up to 10 s) for until() where something must arrive,
    then watch QUIET_S more for what must not."""
    for c in clients:
        await c.nc.flush()
    deadline = asyncio.get_running_loop().time() + 10
    while until is not None and not until() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(QUIET_S)


async def connected(sender: Client, subject: str, got: list, *receivers: Client) -> None:
    """Publish on subject until got holds it (up to 10 s), then empty got: a freshly
    made pair of connections sometimes loses its first messages (nats-server 2.9, seen
    in 1 of 8 tries with or without accounts), which would pass for a refusal."""
    deadline = asyncio.get_running_loop().time() + 10
    while not got:
        assert asyncio.get_running_loop().time() < deadline, f"nothing on {subject} arrives"
        await sender.nc.publish(subject, b"hello")
        for c in (sender, *receivers):
            await c.nc.flush()
        await asyncio.sleep(0.1)
    got.clear()


def violations(client: Client, kind: str) -> list[str]:
    return [e for e in client.errors if "permissions violation" in e.lower() and kind.lower() in e.lower()]
