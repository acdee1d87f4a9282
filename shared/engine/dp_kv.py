"""The KV side of a data-parallel instance in the mesh (EngineConfig.data_parallel_size):
one KV connector for the instance, each rank's pool moving its own requests' blocks
through it, and one view of the ranks' prefix caches for cache-aware routing.

Why one connector rather than one per rank: the ranks share a host, so rank 0 maps
every rank's cache (shared/kv/memory/dp_region.py) and one NATS/kvcache client set, one
report per load and one lease per handoff serve the instance, as for tensor and expert
parallelism (ranked_region.py). The balancer and the handoff see one instance.

- ``RankConnector``: a rank's view of the connector. Lookups and forgets pass through
  (they are per request); loads and saves are recorded as the rank's, so that the
  results the one connector reports (``DataParallelKVTransfer.poll`` polls it once)
  go back to the rank that asked. The ids a rank hands over are already the region's
  instance-wide ones: its ``KVTransfer`` shifts them by the rank's offsets, the held
  blocks a handoff names included.
- ``DataParallelKVTransfer``: what the engine drives of a ``KVTransfer``, over one per
  rank (each with its rank's scheduler and pool). A request's KV work happens in the
  rank it is pinned to (DataParallelScheduler.choose_rank chose it on admission, before
  its lookup: a decode handoff's import lands there).
- ``InstanceBlockEvents``: the instance holds a block hash while any rank does; a
  "stored" goes out when the first rank takes it in, a "removed" when the last lets it go.
"""

from collections import Counter

from shared.engine.kv_transfer import KVTransfer
from shared.engine.outputs import RequestOutput
from shared.engine.scheduler import Scheduler
from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.memory.block_pool import BlockPool
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.transfer import KVTransferParams


class _Results:
    """The one connector's reports, sorted by the rank that started each load or save."""

    def __init__(self, connector: KVConnector, num_ranks: int) -> None:
        self.connector = connector
        self.rank_of: dict[str, int] = {}
        """Requests with a load or a save in flight, by rank."""
        self._in_flight: Counter[str] = Counter()
        """Per request, its loads and saves started and not reported yet (each start
        reports once in poll): its entry goes with the last, so none outlives its request."""
        self.loads: list[list[LoadResult]] = [[] for _ in range(num_ranks)]
        self.saves: list[list[SaveResult]] = [[] for _ in range(num_ranks)]
        self.released: list[list[str]] = [[] for _ in range(num_ranks)]

    def pull(self) -> None:
        loads, saves = self.connector.poll()
        for result in loads:
            self.loads[self._rank(result.request_id)].append(result)
        for save in saves:
            self.saves[self._rank(save.request_id)].append(save)
        # A peer's read of held blocks is done: the rank holding the lease frees them (the others hold none).
        for request_id in self.connector.take_released():
            for released in self.released:
                released.append(request_id)

    def started(self, request_id: str, rank: int) -> None:
        self.rank_of[request_id] = rank
        self._in_flight[request_id] += 1

    def _rank(self, request_id: str) -> int:
        """The rank of a reported load or save (a request's are all on its pinned rank)."""
        rank = self.rank_of[request_id]
        self._in_flight[request_id] -= 1
        if not self._in_flight[request_id]:
            del self._in_flight[request_id], self.rank_of[request_id]
        return rank


class RankConnector(KVConnector):
    """Rank ``rank``'s view of the instance's connector (module docstring)."""

    def __init__(self, results: _Results, rank: int) -> None:
        self.results = results
        self._connector = results.connector
        self.rank = rank

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        return self._connector.lookup(request_id, hashes, params, trace)

    def start_load(
        self, request_id: str, first_block: int, hashes: list[BlockHash], block_ids: BlockIds,
        params: KVTransferParams, trace: TraceCarrier | None = None,
    ) -> None:  # fmt: skip
        self.results.started(request_id, self.rank)
        self._connector.start_load(request_id, first_block, hashes, block_ids, params, trace)

    def start_save(
        self, request_id: str, hashes: list[BlockHash], block_ids: BlockIds, params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:  # fmt: skip
        self.results.started(request_id, self.rank)
        self._connector.start_save(request_id, hashes, block_ids, params, trace)

    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        """This rank's reports among those the last pull took from the connector."""
        r = self.rank
        loads, saves = self.results.loads[r], self.results.saves[r]
        self.results.loads[r], self.results.saves[r] = [], []
        return loads, saves

    def take_released(self) -> list[str]:
        released, self.results.released[self.rank] = self.results.released[self.rank], []
        return released

    def forget(self, request_id: str) -> None:
        self._connector.forget(request_id)

    @property
    def num_pending(self) -> int:
        # The instance's: a rank's transfer stays busy while anything is on its way (the step loop polls on).
        return self._connector.num_pending

    # The counters of saves written behind (0 here) are the instance's: DataParallelKVTransfer counts them once.


class DataParallelKVTransfer:
    """One KVTransfer per rank over the instance's one connector, as the engine drives a KVTransfer."""

    def __init__(
        self, schedulers: list[Scheduler], pools: list[KVCacheCoordinator], offsets: list[dict[int, int]],
        lease_timeout_s: float,
    ) -> None:  # fmt: skip
        """schedulers: each rank's, with its view of the connector (rank_connectors);
        offsets: each rank's block ids' shift in the connector's region (DataParallelKVRegion.offsets)."""
        views = [_view(scheduler, r) for r, scheduler in enumerate(schedulers)]
        self._results = views[0].results
        self.connector = self._results.connector
        """The instance's connector (the engine closes it)."""
        self.ranks = [
            KVTransfer(view, scheduler, kv, lease_timeout_s, offsets[r])
            for r, (view, scheduler, kv) in enumerate(zip(views, schedulers, pools, strict=True))
        ]

    @property
    def num_tracked(self) -> int:
        """Requests with a load or a save not reported yet (their rank is remembered until then)."""
        return len(self._results.rank_of)

    # A rank's counts are its own (its view reports none of the connector's); the connector's are added once.
    @property
    def num_saves_dropped(self) -> int:
        return sum(t.num_saves_dropped for t in self.ranks) + self.connector.num_saves_dropped

    @property
    def num_save_failures(self) -> int:
        return sum(t.num_save_failures for t in self.ranks) + self.connector.num_save_failures_behind

    @property
    def num_leases_expired(self) -> int:
        return sum(t.num_leases_expired for t in self.ranks)

    @property
    def busy(self) -> bool:
        return any(t.busy for t in self.ranks)

    def start_loads(self) -> None:
        for t in self.ranks:
            t.start_loads()

    def poll(self) -> list[RequestOutput]:
        self._results.pull()
        return [out for t in self.ranks for out in t.poll()]

    def finish(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for t in self.ranks:  # each holds back its own requests' outputs; the others pass
            outputs = t.finish(outputs)
        return outputs

    def drop_output(self, request_id: str) -> None:
        for t in self.ranks:
            t.drop_output(request_id)

    def release(self, request_id: str) -> bool:
        return any(t.release(request_id) for t in self.ranks)  # one rank at most holds its lease


def rank_connectors(connector: KVConnector, num_ranks: int) -> list[RankConnector]:
    """Each rank's view of the instance's connector (the schedulers' connectors), sharing its reports."""
    results = _Results(connector, num_ranks)
    return [RankConnector(results, r) for r in range(num_ranks)]


def _view(scheduler: Scheduler, rank: int) -> RankConnector:
    view = scheduler.connector
    if not isinstance(view, RankConnector) or view.rank != rank:
        raise ValueError(f"rank {rank}'s scheduler must have its rank's view of the connector (rank_connectors)")
    return view


class InstanceBlockEvents:
    """The ranks' prefix-cache events as one instance's (module docstring): per hash, how
    many ranks hold it. Each rank's net change is read off its pool (``holds``), since a
    drained interval may have stored and removed the same hash in either order."""

    def __init__(self, pools: list[BlockPool]) -> None:
        self.pools = pools
        self._held: list[set[BlockHash]] = [set() for _ in pools]
        self._count: Counter[BlockHash] = Counter()

    def drain(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """The hashes the instance took in and let go since the last drain or snapshot."""
        before: dict[BlockHash, int] = {}
        for held, pool in zip(self._held, self.pools):
            stored, removed = pool.drain_events()
            for h in dict.fromkeys([*stored, *removed]):
                now = pool.holds(h)
                if now == (h in held):
                    continue
                before.setdefault(h, self._count[h])
                if now:
                    held.add(h)
                    self._count[h] += 1
                else:
                    held.discard(h)
                    self._count[h] -= 1
                    if not self._count[h]:
                        del self._count[h]
        stored_out = [h for h, n in before.items() if n == 0 and self._count[h] > 0]
        removed_out = [h for h, n in before.items() if n > 0 and self._count[h] == 0]
        return stored_out, removed_out

    def snapshot(self) -> list[BlockHash]:
        """Every hash some rank holds now; the pending events are dropped (the snapshot says them)."""
        self._held = [set(pool.snapshot_events()) for pool in self.pools]
        self._count = Counter(h for held in self._held for h in held)
        return list(self._count)
