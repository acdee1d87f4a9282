"""Handoffs decode did not take while the bus recovers from a NATS outage
(services/balancer/router/outage.py's handoff_retry, migration.py): after a NATS
restart prefill may be back on the bus before decode, and each handoff then fails
at once ("no responders"). The request waits a moment and moves again, uncounted,
instead of burning migration_limit + OUTAGE_MOVES in milliseconds and failing with
503 (the 4 requests test_nats_restarted_under_load_costs_no_request once lost).
Outside an outage such failures count as before; inside one, for OUTAGE_WAIT_S."""

import time
from collections.abc import AsyncIterator

import pytest

from services.balancer.generation import GenerationError, GenerationRequest, TokenEvent
from services.balancer.router import outage as outage_mod
from services.balancer.router.failures import InstanceFailed
from services.balancer.router.migration import MigrationLoop
from services.balancer.router.move_budget import RecentDeaths
from services.balancer.router.outage import OUTAGE_MOVES, OutageRecovery
from services.balancer.router.registry import Registry
from shared.engine.sampling_params import SamplingParams
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings
from tests.helpers.clock import Clock


class Bus:
    """The parts of shared.runtime.bus.Bus that OutageRecovery reads: connected, and
    back since `reconnected_at` (monotonic) when set."""

    def __init__(self, reconnected_at: float | None) -> None:
        self.down_since: float | None = None
        self.reconnected_at = reconnected_at
        self.on_reconnected: list = []
        self.connected = True

    async def wait_connected(self, timeout_s: float) -> bool:
        return True


class Attempts:
    """Attempts whose first `failures` handoffs decode does not take; then one streams 3 tokens."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.dispatched: list[tuple[str, float]] = []

    async def run(self, req, images, excluded, root, started, rejected, migration=0) -> AsyncIterator[TokenEvent]:  # noqa: ANN001
        self.dispatched.append((req.request_id, time.monotonic()))
        if len(self.dispatched) <= self.failures:
            raise InstanceFailed("the handoff to decode failed: decode instance d0 did not answer (NoRespondersError)",
                                 "d0", cause="handoff", started=False)  # fmt: skip
        yield TokenEvent([1, 2])
        yield TokenEvent([3], finish_reason="length")


def migration_loop(attempts: Attempts, reconnected_at: float | None) -> tuple[MigrationLoop, Metrics]:
    registry = Registry(misses=3, clock=Clock())
    metrics = Metrics("balancer")
    outage = OutageRecovery(Bus(reconnected_at), registry)
    return MigrationLoop(attempts, outage, RecentDeaths(registry), BalancerSettings(), metrics), metrics  # type: ignore[arg-type]


async def generate(loop: MigrationLoop) -> list[int]:
    req = GenerationRequest("r-1", [5, 6, 7], SamplingParams(max_tokens=3))
    return [t async for event in loop.run(req, None) for t in event.token_ids]  # type: ignore[arg-type]


async def test_handoffs_decode_did_not_take_while_the_bus_recovers_move_uncounted():
    failures = BalancerSettings().migration_limit + OUTAGE_MOVES + 2  # more moves than any budget allows
    attempts = Attempts(failures)
    loop, metrics = migration_loop(attempts, reconnected_at=time.monotonic())
    assert await generate(loop) == [1, 2, 3]
    assert [rid for rid, _ in attempts.dispatched] == ["r-1"] + [f"r-1-m{i}" for i in range(1, failures + 1)]
    assert metrics.registry.get_sample_value("infermesh_balancer_migrations_total", {"cause": "handoff"}) == failures
    # Each move waited a moment for decode to come back (a lower bound: safe on a loaded machine).
    times = [t for _, t in attempts.dispatched]
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.15


async def test_outside_an_outage_the_same_failures_count_against_migration_limit():
    attempts = Attempts(failures=5)
    loop, _ = migration_loop(attempts, reconnected_at=None)
    with pytest.raises(GenerationError) as exc:
        await generate(loop)
    assert exc.value.status == 503
    assert len(attempts.dispatched) == BalancerSettings().migration_limit + 1


async def test_uncounted_moves_stop_after_outage_wait_s(monkeypatch):
    monkeypatch.setattr(outage_mod, "OUTAGE_WAIT_S", 0.5)
    attempts = Attempts(failures=10_000)  # a decode instance that never takes a handoff
    loop, _ = migration_loop(attempts, reconnected_at=time.monotonic())
    with pytest.raises(GenerationError) as exc:
        await generate(loop)
    assert exc.value.status == 503
    # ~0.5 s of uncounted moves (a few, 0.2 s apart), then the counted ones: bounded.
    assert len(attempts.dispatched) <= 0.5 / 0.2 + 1 + BalancerSettings().migration_limit + OUTAGE_MOVES + 1
