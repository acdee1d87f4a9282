"""The move budget, exactly: which of a request's failures count against
migration_limit, on a hand-moved clock (services/balancer/router/move_budget.py)."""

import asyncio

from services.balancer.router.failures import InstanceFailed
from services.balancer.router.move_budget import FREE_MOVES, MoveBudget, RecentDeaths, Tally, budget_for
from services.balancer.router.registry import Registry
from shared.proto import mesh_pb2
from tests.helpers.clock import Clock

INTERVAL_S = 0.5
WINDOW_S = 3 * INTERVAL_S + 0.1  # 3 misses and a sweep


def mesh(*instances: str, interval_s: float = INTERVAL_S) -> tuple[Registry, RecentDeaths, Clock]:
    clock = Clock()
    registry = Registry(misses=3, clock=clock)
    for iid in instances:
        stage = "prefill" if iid.startswith("p") else "decode"
        hb = mesh_pb2.Heartbeat(stage=stage, instance_id=iid, seq=1, interval_s=interval_s)
        assert registry.on_heartbeat(hb) is None
    return registry, RecentDeaths(registry), clock


def fail(budget: MoveBudget, iid: str, started: bool = True, outage: bool = False) -> None:
    budget.record(InstanceFailed("test", iid, started=started), outage)


def test_failures_of_live_instances_are_charged_each():
    _, deaths, _ = mesh("p0", "p1", "d0")
    budget = budget_for(deaths, limit=1, outage_moves=2)
    fail(budget, "p0")
    assert budget.tally() == Tally(charged=1, free=0, outage=0)
    fail(budget, "p1")
    assert budget.tally() == Tally(charged=2, free=0, outage=0)  # over migration_limit 1


def test_an_instance_that_died_without_the_request_costs_nothing():
    registry, deaths, clock = mesh("p0", "d0", "d1")
    budget = budget_for(deaths, limit=1, outage_moves=2)
    registry.leave("d0", "disconnected")
    fail(budget, "d0", started=False)  # decode had streamed nothing: prefill held it
    assert budget.tally() == Tally(charged=0, free=1, outage=0)
    clock.now += 61  # much later (RecentDeaths has forgotten d0), a live instance's error: the budget is whole
    registry.leave("p0", "disconnected")  # another death, which prunes the record of d0's
    assert deaths.of("d0") is None
    fail(budget, "d1")
    assert budget.tally() == Tally(charged=1, free=1, outage=0)


def test_a_move_onto_an_instance_dying_with_the_last_is_free_within_the_detection_window():
    registry, deaths, clock = mesh("p0", "p1", "d0", "d1")
    budget = budget_for(deaths, limit=1, outage_moves=2)
    registry.leave("d0", "disconnected")  # decoding it
    fail(budget, "d0")
    clock.now += 0.1
    registry.leave("p0", "disconnected")  # it had taken the moved request
    fail(budget, "p0")
    assert budget.tally() == Tally(charged=1, free=1, outage=0)
    # Past the detection window after the last death, another death is its own: charged.
    clock.now += WINDOW_S + 0.01
    registry.leave("p1", "disconnected")
    fail(budget, "p1")
    assert budget.tally() == Tally(charged=2, free=1, outage=0)


def test_a_death_heard_after_the_failure_frees_it_retrospectively():
    registry, deaths, clock = mesh("p0", "d0", "d1")
    budget = budget_for(deaths, limit=1, outage_moves=2)
    fail(budget, "d0", started=False)  # prefill: "decode instance d0 did not answer"
    assert budget.tally() == Tally(charged=1, free=0, outage=0)
    clock.now += 0.05
    registry.leave("d0", "disconnected")  # its advisory, a moment later
    assert budget.tally() == Tally(charged=0, free=1, outage=0)


def test_free_moves_are_bounded():
    names = [f"p{i}" for i in range(FREE_MOVES + 3)]
    registry, deaths, clock = mesh(*names, "d0")
    budget = budget_for(deaths, limit=1, outage_moves=2)
    for iid in names:  # a poison request: each instance it lands on dies with it
        clock.now += 0.2
        registry.leave(iid, "disconnected")
        fail(budget, iid)
    # The first death is charged, FREE_MOVES then are one incident's, the rest charged again.
    assert budget.tally() == Tally(charged=len(names) - FREE_MOVES, free=FREE_MOVES, outage=0)


def test_outage_moves_count_apart():
    _, deaths, _ = mesh("p0", "d0")
    budget = budget_for(deaths, limit=1, outage_moves=2)
    fail(budget, "p0", outage=True)
    fail(budget, "p0", outage=True)
    fail(budget, "p0")
    assert budget.tally() == Tally(charged=1, free=0, outage=2)


async def test_before_failing_a_request_the_last_instance_gets_its_window_to_be_heard_leaving():
    registry, deaths, _ = mesh("p0", "d0", "d1", interval_s=0.05)  # a 0.25 s window
    budget = budget_for(deaths, limit=0, outage_moves=2)
    fail(budget, "d0", started=False)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, registry.leave, "d0", "disconnected")
    assert await asyncio.wait_for(budget.allows_move(), 5)  # its death came: the move is free
    fail(budget, "d1", started=False)  # d1 stays: after its window, no
    assert not await asyncio.wait_for(budget.allows_move(), 5)


async def test_no_wait_when_the_last_instance_dying_would_change_nothing():
    _, deaths, _ = mesh("p0", "p1", "d0", interval_s=3.0)  # a 9.1 s window
    budget = budget_for(deaths, limit=1, outage_moves=2)
    fail(budget, "p0")
    fail(budget, "p1")  # started, and no death moved it there: charged, dead or not
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await asyncio.wait_for(budget.allows_move(), 20)
    assert loop.time() - started < 4.5  # not the 9.1 s window (half of it: a loaded machine)
