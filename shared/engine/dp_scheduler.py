"""The scheduler of an instance with data-parallel attention (EngineConfig.data_parallel_size):
one ``Scheduler`` per rank, each over its own KV pool (a ``KVCacheCoordinator``: the
block ids in a rank's step are ids in that rank's cache), behind the interface the
engine steps a single scheduler through.

Why one scheduler per rank rather than one over N pools: a request's KV lives on the
rank that computed it, so it is pinned there for its life (preempted, it is recomputed
there too), and everything a scheduler decides (budget, preemption, prefix hits,
chunking) is then a per-rank decision that the single-rank code already makes. Each
rank keeps its own max_num_seqs and token budget, as a vLLM DP rank (its own engine
core) does.

Assignment (``choose_rank``), when a request is added: the rank where it costs least,
counting the KV tokens the rank's own requests hold or will hold (every token of each
unfinished one: what its attention reads each step and its pool must keep) plus the
request's tokens that the rank's prefix cache does not hold (a hit's blocks are shared,
not computed again). So a repeated prompt goes to the rank that holds its prefix unless
that rank is busier by more than the hit saves, and otherwise the least loaded rank
takes it; ties go to the lowest rank. Prefix caching is per rank: a hit is only ever on
the rank the request runs on.

The tokens per expert (EPLB's counts, EngineLoad) include one padding token's routing
per idle rank per step: the pad runs the router like any token, and the counts are
summed over the ranks on the device before anyone could tell them apart.

With a KV connector (a mesh instance) each rank's scheduler has its rank's view of the
instance's one connector (shared/engine/dp_kv.py): a request's lookup, its load (a
kvcache hit, a decode handoff's import: chosen its rank first, on admission, as any
request) and its save all happen in the rank it is pinned to.

Each step every scheduler schedules; the step's lists are theirs joined (what the engine
reads: outputs, counts) with each rank's own step in ``SchedulerOutput.ranks`` (what the
executor sends each rank). An idle rank whose peers have work gets ``pad_forward``.
"""

from collections import ChainMap, deque
from collections.abc import Sequence

from shared.engine.request import Request, RequestStatus
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.step import SchedulerOutput
from shared.kv.memory.coordinator import StateSave


class DataParallelScheduler:
    def __init__(self, schedulers: Sequence[Scheduler]) -> None:
        if len(schedulers) < 2:
            raise ValueError("data-parallel attention needs a scheduler per rank, at least 2")
        self.ranks = list(schedulers)
        self.rank_of: dict[str, int] = {}
        """The rank of every unfinished request (pinned: its KV lives there)."""
        self.step_tokens: deque[int] = deque(maxlen=1 << 16)
        """Tokens each non-empty step schedules over all ranks (Scheduler.step_tokens: the
        instance's vllm:iteration_tokens_total)."""

    # -- what the engine reads of a Scheduler -----------------------------------

    @property
    def config(self) -> SchedulerConfig:
        return self.ranks[0].config

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def requests(self) -> ChainMap[str, Request]:
        return ChainMap(*(s.requests for s in self.ranks))

    @property
    def num_unfinished(self) -> int:
        return sum(s.num_unfinished for s in self.ranks)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    @property
    def num_running_per_rank(self) -> list[int]:
        return [len(s.running) for s in self.ranks]

    @property
    def state_saves(self) -> list[StateSave]:
        return [save for s in self.ranks for save in s.state_saves]

    @state_saves.setter
    def state_saves(self, saves: list[StateSave]) -> None:
        assert not saves, "state saves are only ever taken, all at once"
        for s in self.ranks:
            s.state_saves = []

    # -- intake ----------------------------------------------------------------

    def choose_rank(self, request: Request) -> int:
        """The rank where the request costs least (module docstring)."""
        max_blocks = (request.num_tokens - 1) // self.ranks[0].kv.block_size

        def cost(rank: int) -> int:
            s = self.ranks[rank]
            held = sum(r.num_tokens for r in (*s.waiting, *s.running, *s.loading.values()))
            cached = s.kv.num_cached_persistent_blocks(request, max_blocks) * s.kv.block_size
            return held + request.num_tokens - cached

        return min(range(len(self.ranks)), key=cost)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.rank_of:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        rank = self.choose_rank(request)
        self.ranks[rank].add_request(request)
        self.rank_of[request.request_id] = rank

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.ranks[rank].finish_request(request_id, status)

    def drop_last_tokens(self, request: Request, num_tokens: int) -> None:
        self.ranks[self.rank_of[request.request_id]].drop_last_tokens(request, num_tokens)

    # -- the step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        parts = [s.schedule() for s in self.ranks]
        if any(not p.is_empty for p in parts):
            for p in parts:
                p.pad_forward = p.is_empty
        out = SchedulerOutput(ranks=parts)
        for p in parts:
            out.new_requests += p.new_requests
            out.chunks += p.chunks
            out.finished_request_ids |= p.finished_request_ids
            out.preempted_request_ids |= p.preempted_request_ids
            out.state_loads += p.state_loads
        if out.chunks:
            self.step_tokens.append(sum(p.num_scheduled_tokens for p in parts))
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[tuple[Request, list[int]]]:
        updated: list[tuple[Request, list[int]]] = []
        for scheduler, part in zip(self.ranks, out.ranks, strict=True):
            updated += scheduler.update_from_output(part, sampled)
        for request, _ in updated:
            if request.status.is_finished:
                self.rank_of.pop(request.request_id, None)
        return updated
