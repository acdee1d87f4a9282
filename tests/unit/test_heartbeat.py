"""An instance's heartbeats (shared/runtime/heartbeat.py), the one loop that the engine
stages (shared/stage/worker.py) and the vision stage (services/vision/service.py)
share: what each beat says, registration, a NATS outage, the beat on reconnect and the
engine stages' duty after each beat. A stand-in for the bus records what is published
(the mesh tests, tests/mesh/test_mesh_vision.py and test_worker_ready.py, see it
through a real nats-server)."""

import asyncio
import logging
from collections.abc import Callable

import pytest
from google.protobuf.message import Message

from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import CONNECTION_HEADER
from shared.runtime.heartbeat import BeatIdentity, BeatState, Heartbeats

IDENTITY = BeatIdentity("vision", "vision-0", "tiny-vl", 0.01)


class RecordingBus:
    """What Heartbeats uses of shared.runtime.bus.Bus, recording each publish."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, mesh_pb2.Heartbeat, dict[str, str]]] = []
        self.on_reconnected: list[Callable[[], None]] = []
        self.down = False

    def connection_id(self) -> str:
        return "SERVER/7"

    async def publish(self, subject: str, message: Message, headers: dict[str, str] | None = None) -> None:
        if self.down:
            raise ConnectionError("nats down")
        assert isinstance(message, mesh_pb2.Heartbeat)
        self.sent.append((subject, message, dict(headers or {})))


def _state(running: int = 2, draining: bool = False) -> BeatState:
    return BeatState(mesh_pb2.Load(num_running=running, num_waiting=3), draining, (b"a" * 32, b"b" * 32))


def test_a_beat_says_who_its_load_and_its_connection():
    async def main() -> None:
        bus = RecordingBus()
        beats = Heartbeats(bus, IDENTITY, _state)  # type: ignore[arg-type]
        assert not beats.registered
        await beats.send()
        await beats.send()
        assert beats.registered
        (subject, first, headers), (_, second, _) = bus.sent
        assert subject == subjects.heartbeat("vision", "vision-0")
        assert headers == {CONNECTION_HEADER: "SERVER/7"}
        assert (first.seq, second.seq) == (1, 2)
        assert (first.stage, first.instance_id, first.model, first.interval_s) == ("vision", "vision-0", "tiny-vl", 0.01)
        assert (first.load.num_running, first.load.num_waiting, first.draining) == (2, 3, False)
        assert list(first.image_hashes) == [b"a" * 32, b"b" * 32]
        assert first.unix_time > 0

    asyncio.run(main())


def test_a_beat_while_nats_is_down_is_dropped_and_does_not_register():
    async def main() -> None:
        bus = RecordingBus()
        bus.down = True
        beats = Heartbeats(bus, IDENTITY, _state)  # type: ignore[arg-type]
        await beats.send()  # no exception: the next beat retries
        assert not beats.registered and not bus.sent
        bus.down = False
        await beats.send()
        assert beats.registered and bus.sent[0][1].seq == 2  # the lost beat used its seq

    asyncio.run(main())


def test_a_failed_publish_is_logged_once_per_outage_with_its_cause(caplog):
    """Not swallowed: the first beat lost says so (a warning naming the instance, the
    subject and NATS's error); the rest of the outage, debug lines; the first beat through
    says how many were lost."""
    async def main() -> None:
        bus = RecordingBus()
        beats = Heartbeats(bus, IDENTITY, _state)  # type: ignore[arg-type]
        bus.down = True
        for _ in range(3):
            await beats.send()
        assert beats.num_failed == 3
        bus.down = False
        await beats.send()
        assert beats.num_failed == 0 and beats.registered

    with caplog.at_level(logging.DEBUG, logger="shared.runtime.heartbeat"):
        asyncio.run(main())
    records = [r for r in caplog.records if r.name == "shared.runtime.heartbeat"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING]
    first = records[0].getMessage()
    assert "vision-0" in first and subjects.heartbeat("vision", "vision-0") in first and "nats down" in first
    assert "after 3 failed" in records[-1].getMessage()


def test_a_failing_after_beat_is_logged(caplog):
    async def main() -> None:
        bus = RecordingBus()

        async def after_beat() -> None:
            raise RuntimeError("kvcache unreachable")

        task = Heartbeats(bus, IDENTITY, _state, after_beat).start()  # type: ignore[arg-type]
        while len(bus.sent) < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.ERROR, logger="shared.runtime.heartbeat"):
        asyncio.run(main())
    assert any(r.exc_info and "kvcache unreachable" in str(r.exc_info[1]) for r in caplog.records)


def test_the_state_is_read_at_each_beat():
    async def main() -> None:
        bus = RecordingBus()
        draining = [False]
        beats = Heartbeats(bus, IDENTITY, lambda: _state(draining=draining[0]))  # type: ignore[arg-type]
        await beats.send()
        draining[0] = True
        await beats.send()
        assert [hb.draining for _, hb, _ in bus.sent] == [False, True]

    asyncio.run(main())


def test_the_loop_beats_every_interval_and_survives_a_failing_after_beat():
    async def main() -> None:
        bus = RecordingBus()
        calls: list[int] = []

        async def after_beat() -> None:
            calls.append(len(bus.sent))  # runs after the beat went out
            raise RuntimeError("kvcache unreachable")

        beats = Heartbeats(bus, IDENTITY, _state, after_beat)  # type: ignore[arg-type]
        task = beats.start()
        while len(bus.sent) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [hb.seq for _, hb, _ in bus.sent][:3] == [1, 2, 3]
        assert calls[:2] == [1, 2]

    asyncio.run(main())


def test_a_reconnect_beats_at_once():
    async def main() -> None:
        bus = RecordingBus()
        beats = Heartbeats(bus, BeatIdentity("decode", "decode-0", "m", 3600.0), _state)  # type: ignore[arg-type]
        task = beats.start()
        while not bus.sent:  # the loop's first beat; the next is an hour away
            await asyncio.sleep(0.005)
        for callback in bus.on_reconnected:
            callback()
        while len(bus.sent) < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        assert [hb.seq for _, hb, _ in bus.sent] == [1, 2]

    asyncio.run(main())
