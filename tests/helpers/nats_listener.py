"""A NATS subscription on a thread of its own, for tests that watch a running
mesh's subjects (heartbeats, KV events) while the test itself blocks."""

import asyncio
import threading
from collections.abc import Callable

import nats


class Listener:
    """A NATS subscription on a thread of its own, started once the mesh's address is known."""

    def __init__(self, subject: str, on_msg: Callable[[nats.aio.msg.Msg], None]) -> None:
        self.subject = subject
        self.on_msg = on_msg
        self.nats_url: str | None = None

    def start(self, nats_url: str) -> None:
        self.nats_url = nats_url
        ready = threading.Event()

        async def run() -> None:
            nc = await nats.connect(nats_url, allow_reconnect=False)

            async def cb(msg) -> None:  # noqa: ANN001
                self.on_msg(msg)

            await nc.subscribe(self.subject, cb=cb)
            await nc.flush()
            ready.set()
            await asyncio.sleep(3600)  # a daemon thread: ends with the test process

        threading.Thread(target=lambda: asyncio.run(run()), daemon=True).start()
        assert ready.wait(10)
