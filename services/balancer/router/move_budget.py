"""The move budget: which of a request's moves count against migration_limit.

A move counts when the attempt it ends had a fair chance. One did not when an
instance at fault died (left the registry, see registry.py and departures.py)
and either
  - it never had the request, as far as the balancer knows: a dispatch it did
    not ack, a handoff it did not answer, a decode instance that had streamed
    nothing of it (prefill held it, or had only just handed it over); or
  - the request had just been moved off another instance's death, and this one
    died within a detection window of that one (detection_window, below): the
    move landed on an instance dying with the first one, as a node takes its
    prefill and decode instances down together.
Such moves are free, up to FREE_MOVES per request; past that they count, so a
request that kills every instance it lands on (a "poison" request) still fails
after at most migration_limit + FREE_MOVES + 1 attempts. Moves in a NATS outage
count apart (outage.py's OUTAGE_MOVES), as before.

A failure is judged again at every later one, with what the registry knows by
then: a decode instance that did not answer a handoff is usually heard to have
left a moment after prefill reports it. Before a request fails for its budget,
the last failure's instances get their detection window to be heard leaving.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.balancer.router.failures import InstanceFailed
from services.balancer.router.registry import SWEEP_INTERVAL_S, Instance, Registry

FREE_MOVES = 3
"""Moves a request may make, on top of migration_limit, off instances that had no
fair chance at it. Three: a request survives the death of two prefill and two
decode instances around it (a node hosting them, or two nodes), each of which may
fail it once."""
KEEP_S = 60.0
"""How long a death is remembered: far longer than a detection window (only deaths
near a failure count), short enough that the record stays small."""


def detection_window(misses: int, interval_s: float) -> float:
    """How long the registry may take to hear of an instance's death: its missed
    heartbeats and a sweep (nats-server's advisory usually tells in milliseconds)."""
    return misses * interval_s + SWEEP_INTERVAL_S


@dataclass(slots=True, frozen=True)
class Death:
    at: float
    """When the registry dropped the instance (the registry's clock)."""
    window_s: float
    """Its detection window (detection_window)."""


class RecentDeaths:
    """The instances the registry dropped lately (dead, restarted or gone silent), mesh-wide."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._deaths: dict[str, Death] = {}
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        registry.on_removed.append(self._on_removed)

    def _on_removed(self, inst: Instance, why: str) -> None:
        now = self.registry.clock()
        for iid in [i for i, d in self._deaths.items() if now - d.at > KEEP_S]:
            del self._deaths[iid]
        self._deaths[inst.instance_id] = Death(now, detection_window(self.registry.misses, inst.interval_s))
        for fut in self._waiting.pop(inst.instance_id, set()):
            if not fut.done():
                fut.set_result(None)

    def of(self, instance_id: str) -> Death | None:
        return self._deaths.get(instance_id)

    def window_s(self, instance_id: str) -> float:
        """The instance's detection window (the registry's default heartbeat when unknown)."""
        death = self._deaths.get(instance_id)
        if death is not None:
            return death.window_s
        inst = self.registry.get(instance_id)
        return detection_window(self.registry.misses, inst.interval_s if inst is not None else 1.0)

    async def wait_gone(self, instance_ids: set[str], timeout_s: float) -> None:
        """Until one of the instances is no longer in the registry, or timeout_s passes."""
        if not instance_ids or any(self.registry.get(i) is None for i in instance_ids):
            return
        loop = asyncio.get_running_loop()
        futs = {i: loop.create_future() for i in instance_ids}
        for iid, fut in futs.items():
            self._waiting.setdefault(iid, set()).add(fut)
        try:
            await asyncio.wait(futs.values(), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for iid, fut in futs.items():
                waiting = self._waiting.get(iid)
                if waiting is not None:
                    waiting.discard(fut)
                    if not waiting:
                        del self._waiting[iid]


@dataclass(slots=True, frozen=True)
class Failure:
    """One failed attempt of a request, as the budget remembers it."""

    at: float
    instance_ids: frozenset[str]
    started: bool
    """Whether the instances at fault had started on the request (InstanceFailed.started)."""
    outage: bool
    """Counted against OUTAGE_MOVES instead (a NATS outage's)."""


@dataclass(slots=True, frozen=True)
class Tally:
    charged: int
    """Moves counted against migration_limit (the last failure's included)."""
    free: int
    """Moves off instances that had no fair chance (at most FREE_MOVES)."""
    outage: int


class MoveBudget:
    """One request's moves: whether the next may be made."""

    def __init__(self, deaths: RecentDeaths, limit: int, outage_moves: int, clock: Callable[[], float]) -> None:
        self.deaths = deaths
        self.limit = limit
        self.outage_moves = outage_moves
        self.clock = clock
        self.failures: list[Failure] = []
        self._deaths_found: dict[int, Death] = {}
        """Per failure (its index), the death found for it: kept, as RecentDeaths forgets."""

    def record(self, exc: InstanceFailed, outage: bool) -> None:
        self.failures.append(Failure(self.clock(), frozenset(exc.instance_ids), exc.started, outage))

    def _death(self, k: int) -> Death | None:
        """The death of an instance at fault in failure k, heard within its detection window of it."""
        if k in self._deaths_found:
            return self._deaths_found[k]
        f = self.failures[k]
        found = [d for i in f.instance_ids if (d := self.deaths.of(i)) is not None and abs(d.at - f.at) <= d.window_s]
        death = min(found, key=lambda d: d.at, default=None)
        if death is not None:
            self._deaths_found[k] = death
        return death

    def tally(self, last_dies: Death | None = None) -> Tally:
        """The failures so far, judged with what the registry knows now (last_dies: as if
        the last failure's instance had died then)."""
        charged = free = outage = 0
        previous: Death | None = None  # the death that moved the request off its last attempt
        for k, f in enumerate(self.failures):
            if f.outage:
                outage += 1
                continue
            death = self._death(k)
            if k == len(self.failures) - 1 and last_dies is not None:
                death = death or last_dies
            fair = death is None or (
                f.started and (previous is None or abs(death.at - previous.at) > max(death.window_s, previous.window_s))
            )
            if not fair and free < FREE_MOVES:
                free += 1
            else:
                charged += 1
            previous = death
        return Tally(charged, free, outage)

    def _over(self, tally: Tally) -> bool:
        if self.failures[-1].outage:
            return tally.outage > self.outage_moves
        return tally.charged > self.limit

    async def allows_move(self) -> bool:
        """After record(): whether the request may move again. Before saying no, when the
        death of the last failure's instances would make its move free, they get their
        detection window to be heard leaving (a handoff decode did not answer is often
        its death, told a moment later)."""
        if not self._over(self.tally()):
            return True
        last = self.failures[-1]
        if last.outage or not last.instance_ids:
            return False
        window = max(self.deaths.window_s(i) for i in last.instance_ids)
        if self._over(self.tally(last_dies=Death(last.at, window))):
            return False  # its instance's death would change nothing: no wait
        await self.deaths.wait_gone(set(last.instance_ids), last.at + window - self.clock())
        return not self._over(self.tally())


def budget_for(deaths: RecentDeaths, limit: int, outage_moves: int) -> MoveBudget:
    """A new request's budget, on the registry's clock (so deaths and failures compare)."""
    return MoveBudget(deaths, limit, outage_moves, deaths.registry.clock)
