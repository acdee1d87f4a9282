"""Continuous batching by token budget (the scheduler decides; it runs no model).

Every step, running requests go first (one token each when decoding, the next
chunk when still prefilling), then waiting ones are admitted while the token
budget, the sequence limit and the KV pool allow. Prefill and decode are the
same loop: a request simply needs more tokens while its prompt is not yet
computed, capped per step by the prefill chunk size. When the pool runs out,
the most recently admitted running request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later (its
prefix will often still be cached).

With a KV connector, a waiting request whose prompt the connector's source
holds beyond the local prefix cache first gets blocks reserved for that part
and waits in WAITING_FOR_KV while the engine loads them; it then returns to the
front of the queue and is admitted like any other, hitting the loaded blocks.
A request whose lookup is still on its way is passed over, not waited for; one whose
load finds no free blocks to land in waits for them at the head of the queue (FCFS), as
an admission does, rather than computing what its source holds.

A structured request whose grammar still compiles on the engine's pool waits in
WAITING_FOR_GRAMMAR, passed over the same way: the batch runs on without it.
"""

import enum
import time
from collections import deque
from dataclasses import dataclass

from shared.engine.config import EngineConfig
from shared.engine.request import Request, RequestStatus
from shared.engine.step import PLACEHOLDER, NewRequestData, ScheduledChunk, SchedulerOutput, StateLoad
from shared.kv.connectors.base import KVConnector
from shared.kv.memory.coordinator import KVCacheCoordinator, PrefixHit, StateSave


class KVWait(enum.Enum):
    """What a waiting request waits for from the KV connector (Scheduler._kv_wait)."""

    NONE = "none"
    """Nothing: admitted as any request (no load, or the local cache holds it all)."""
    LOOKUP = "lookup"
    """The connector's answer, on its way: passed over, asked again next step."""
    LOADING = "loading"
    """Its load, into blocks just reserved (WAITING_FOR_KV)."""
    ROOM = "room"
    """Free blocks for its load to land in: it stays at the head of the queue."""


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's share of EngineConfig (whose fields say what each means and
    hold the one default), with max_model_len resolved against the model."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    max_model_len: int

    @classmethod
    def from_engine_config(cls, config: EngineConfig, max_model_len: int) -> "SchedulerConfig":
        return cls(config.max_num_seqs, *config.step_sizes(), max_model_len)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheCoordinator, connector: KVConnector | None = None
    ) -> None:
        """connector: where KV beyond the local cache comes from (None: nowhere)."""
        if kv.pool.num_blocks < kv.num_blocks_needed(config.max_model_len):
            raise ValueError(
                f"the KV cache has {kv.pool.num_blocks} blocks of {kv.block_size} tokens (per size class), fewer than "
                f"max_model_len={config.max_model_len} needs in its {len(kv.managers)} KV group(s): one "
                "request could never fit; give the cache more blocks or lower max_model_len"
            )
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seen_by_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        """Preemptions since start: a figure for metrics and tests."""
        self.step_tokens: deque[int] = deque(maxlen=1 << 16)
        """Tokens each non-empty step schedules, newest last: vllm:iteration_tokens_total,
        drained by a worker's metrics on another thread (deque appends and pops are
        atomic). Bounded, so an engine nobody drains does not grow."""
        self._window = kv.layout.max_window or 0
        """A sliding floor stops mattering once queries are a window past it."""
        self.connector = connector if kv.layout.persistent_groups else None
        self.loading: dict[str, Request] = {}
        """Requests in WAITING_FOR_KV, by id."""
        self.loads_to_start: list[tuple[Request, int, int]] = []
        """(request, first block, number of blocks) the engine asks the connector to load."""
        self.kv_finished: list[Request] = []
        """Finished requests whose prompt blocks the engine saves or holds for a peer."""
        self.num_kv_load_failures = 0
        self.state_saves: list[StateSave] = []
        """Sliding-window states of requests that ended, for the engine to copy before
        the next schedule (which may hand their blocks out)."""

    # -- intake --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; this model takes at most "
                f"{limit} tokens including the output"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside the step (abort, stop string). Unknown or
        already finished ids are ignored: aborts race with normal finishes."""
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            # Its reservation stays until the load reports (the engine releases it then):
            # the connector may be writing into those blocks right now.
            del self.loading[request_id]
        else:
            self.waiting.remove(request)
            self.kv.release_reserved(request_id)  # loaded, not yet admitted
        if self.connector is not None:
            self.connector.forget(request_id)
        self._finish(request, status)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    # -- the step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # Prompts are cut into chunks only while other requests decode, so that their
        # next token waits for one chunk at most; a step of prompts alone takes the budget.
        # A request whose last token is already on the device is not decoding: on a
        # prefill instance (max_tokens 1) counting it cut every other step to one chunk.
        decoding = any(self._remaining(r) == 1 and not self._will_finish(r) for r in self.running)
        chunk_size = self.config.prefill_chunk_size if decoding else budget

        # 1. Running requests, oldest first; the youngest are preempted for them.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._will_finish(request):
                i += 1  # its last token is still on the device: nothing more to compute
                continue
            num_new = min(self._remaining(request), chunk_size, budget)
            num_spec = self._num_spec_tokens(request, budget) if num_new == 1 else 0
            num_new += num_spec
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, num_spec))
                budget -= num_new
                i += 1

        # 2. Waiting requests, in arrival order, unless this step already preempted.
        passed_over: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not out.preempted_request_ids
        ):
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                if not request.grammar_ready:  # compiling on the engine's pool: look again next step
                    passed_over.append(self.waiting.popleft())
                    continue
                request.status, request.grammar = RequestStatus.WAITING, None
            wait = self._kv_wait(request)
            if wait is KVWait.ROOM:
                break  # its load waits for blocks to come free, as an admission does; FCFS
            if wait is not KVWait.NONE:
                self.waiting.popleft()
                if wait is KVWait.LOOKUP:
                    passed_over.append(request)  # its lookup is on its way: ask again next step
                continue
            hit = self._prefix_hit(request)
            num_new = min(request.num_tokens + request.num_pending_tokens - hit.num_computed, chunk_size, budget)
            if not self.kv.allocate_slots(request, num_new, hit):
                break  # wait for blocks to come free; FCFS, so nobody overtakes
            self.waiting.popleft()
            self.kv.release_reserved(request.request_id)  # the hit holds loaded blocks now
            request.num_computed_tokens = hit.num_computed
            request.replay_until = hit.num_tokens if hit.is_replay else 0
            request.sliding_floor = hit.num_computed if hit.is_replay else 0
            request.num_replayed_tokens += hit.num_tokens - hit.num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            if hit.state is not None:
                out.state_loads.append(
                    StateLoad(request.request_id, hit.state, self.kv.state_block_ids(request.request_id, hit.state))
                )
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append((request, num_new, 0))
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))

        for request, num_new, num_spec in scheduled:
            chunk = self._make_chunk(request, num_new, out, request.spec_token_ids[:num_spec])
            out.chunks.append(chunk)
            request.num_computed_tokens += num_new
            request.spec_token_ids = []  # a draft is verified once; the next step drafts anew
            if chunk.sample:
                request.num_pending_tokens += 1
        if out.chunks:
            self.step_tokens.append(out.num_scheduled_tokens)
        return out

    def _num_spec_tokens(self, request: Request, budget: int) -> int:
        """How many of the request's drafted tokens this step verifies: all the engine
        proposed, but no more than the budget left after its own token, and none that
        would run past max_tokens or max_model_len (the step emits one token more
        than it accepts). Only a decoding request whose last token is on the host drafts."""
        if not request.spec_token_ids or request.num_pending_tokens or request.num_output_tokens == 0:
            return 0
        params = request.sampling_params
        room = min(
            params.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens
        ) - 1
        return max(min(len(request.spec_token_ids), budget - 1, room), 0)

    def _prefix_hit(self, request: Request) -> PrefixHit:
        """The cached prefix the request adopts: none when it scores its prompt
        (prompt_logprobs), whose every position must be computed (vLLM does the same)."""
        if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
            return PrefixHit([[] for _ in self.kv.managers])
        return self.kv.find_prefix_hit(request)

    @staticmethod
    def _remaining(request: Request) -> int:
        """Tokens the request has yet to compute (1 while it decodes)."""
        return request.num_tokens + request.num_pending_tokens - request.num_computed_tokens

    def _kv_wait(self, request: Request) -> "KVWait":
        """What the request waits for from the connector before its admission (KVWait).

        A load that finds no room waits for blocks to come free at the head of the
        queue, as an admission that finds none does; it never computes instead. The
        prompt needs those blocks either way, so computing could start no sooner, and a
        decode handoff's KV, already computed by prefill and held for it under a lease,
        would be computed twice (in an 8k-prompt run at 1, 4 and 16 clients on one H100,
        34 of 126 handoffs did, arriving while decode's pool was full). A lease that ends
        while the request waits leaves the connector's store behind it to load from, or
        a visible recompute."""
        if self.connector is None or (request.kv_lookup_done and not request.kv_awaits_room):
            return KVWait.NONE
        transfer = request.kv_transfer
        if transfer is None or not transfer.load or request.sampling_params.prompt_logprobs is not None:
            return KVWait.NONE  # nothing to load, or a prompt to score: computed in full
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        local = self.kv.num_cached_persistent_blocks(request, max_blocks)
        if request.kv_awaits_room:
            held = request.num_external_blocks  # looked up before: the source's answer stands
        else:
            if local >= max_blocks:
                request.kv_lookup_done = True
                return KVWait.NONE
            looked_up = self.connector.lookup(
                request.request_id, request.block_hashes[:max_blocks], transfer, request.trace_carrier
            )
            if looked_up is None:
                return KVWait.LOOKUP
            held = looked_up
            request.kv_lookup_done = True
            request.num_external_blocks = held
        if held <= local:
            request.kv_awaits_room = False
            return KVWait.NONE
        if not self.kv.reserve_for_load(request, held - local):
            request.kv_awaits_room = True
            return KVWait.ROOM
        request.kv_awaits_room = False
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = request
        self.loads_to_start.append((request, local, held - local))
        return KVWait.LOADING

    def finish_load(self, request_id: str, num_loaded: int, num_expected: int) -> None:
        """A load ended (num_loaded of num_expected blocks arrived and are indexed): the
        request goes back to the front of the queue; what did not arrive is recomputed."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return  # aborted while loading
        request.num_loaded_blocks = num_loaded
        if num_loaded < num_expected:
            request.kv_load_failed = True
            self.num_kv_load_failures += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _will_finish(self, request: Request) -> bool:
        """A request whose pending tokens already reach its length limit."""
        if not request.num_pending_tokens:
            return False
        limit = min(request.sampling_params.max_tokens, self.config.max_model_len - request.num_prompt_tokens)
        return request.num_output_tokens + request.num_pending_tokens >= limit

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Append each request's sampled tokens (one, or with speculative decoding the
        accepted drafted tokens and the correction or bonus token) until one stops it,
        rolling rejected drafted tokens back; returns the requests that received
        tokens, with those tokens (finished requests included)."""
        updated: list[tuple[Request, list[int]]] = []
        for chunk in out.chunks:
            tokens = sampled.get(chunk.request_id)
            request = self.requests.get(chunk.request_id)
            if request is not None and chunk.sample:
                request.num_pending_tokens -= 1
            if not tokens or request is None or request.status.is_finished:
                continue  # not a sampling chunk, or finished / aborted while the step ran
            accepted: list[int] = []
            for token in tokens:
                request.append_output_token(token)
                accepted.append(token)
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            else:
                self._roll_back_rejected(request, chunk, len(tokens) - 1)
            updated.append((request, accepted))
        return updated

    def _roll_back_rejected(self, request: Request, chunk: ScheduledChunk, num_accepted: int) -> None:
        """Drafted tokens past the accepted ones hold KV of tokens that are not the
        request's: its computed length falls back to the accepted run (the emitted
        correction or bonus token is the next step's input) and every KV group frees
        the blocks past it."""
        num_rejected = len(chunk.spec_token_ids) - num_accepted
        if num_rejected > 0:
            request.num_computed_tokens -= num_rejected
            self.kv.rollback(request)

    def drop_last_tokens(self, request: Request, num_tokens: int) -> None:
        """Take back the last output tokens that update_from_output appended (a stop
        string ended the request earlier in an accepted speculative run). Only before
        the request is scheduled again; the caller finishes it."""
        assert 0 < num_tokens <= request.num_output_tokens
        del request.output_token_ids[-num_tokens:]
        del request.all_token_ids[-num_tokens:]
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)

    # -- internals -----------------------------------------------------------

    def _make_chunk(
        self, request: Request, num_new: int, out: SchedulerOutput, spec_token_ids: list[int]
    ) -> ScheduledChunk:
        if request.request_id not in self._seen_by_runner:
            self._seen_by_runner.add(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.eos_token_ids,
                    list(request.output_token_ids),
                    request.images,
                )
            )
        start = request.num_computed_tokens
        num_known = num_new - len(spec_token_ids)
        token_ids = request.all_token_ids[start : start + num_known]
        token_ids += [PLACEHOLDER] * (num_known - len(token_ids))
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids + spec_token_ids,
            start_pos=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_known == request.num_tokens + request.num_pending_tokens,
            spec_token_ids=tuple(spec_token_ids),
            # Only while they matter: a decode step past them may then replay a CUDA graph.
            replay_until=request.replay_until if start < request.replay_until else 0,
            sliding_floor=request.sliding_floor if start < request.sliding_floor + self._window - 1 else 0,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request, save_state=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.replay_until = request.sliding_floor = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        transfer = request.kv_transfer
        if (
            self.connector is not None
            and transfer is not None
            and (transfer.save or transfer.hold)
            and status != RequestStatus.FINISHED_ABORTED
        ):
            self.kv_finished.append(request)  # before free: its blocks stay indexed until the next schedule
        save = self.kv.free(request)
        if save is not None:
            self.state_saves.append(save)
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)
