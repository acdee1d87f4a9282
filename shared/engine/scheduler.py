"""Continuous batching by token budget (the scheduler decides; it runs no model).

Every step, running requests go first (one token each when decoding, the next
chunk when still prefilling), then waiting ones are admitted while the token
budget, the sequence limit and the KV pool allow. Prefill and decode are the
same loop: a request simply needs more tokens while its prompt is not yet
computed, capped per step by the prefill chunk size. When the pool runs out,
the most recently admitted running request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later (its
prefix will often still be cached).
"""

from collections import deque
from dataclasses import dataclass

from shared.engine.kv.coordinator import KVCacheCoordinator, StateSave
from shared.engine.request import Request, RequestStatus
from shared.engine.step import PLACEHOLDER, NewRequestData, ScheduledChunk, SchedulerOutput, StateLoad


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests in the running batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens)."""
    prefill_chunk_size: int = 512
    """Most prompt tokens of one request computed in one step."""
    max_model_len: int = 4096
    """Longest prompt + output a request may reach."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheCoordinator) -> None:
        if kv.pool.num_blocks < kv.num_blocks_needed(config.max_model_len):
            raise ValueError(
                f"the KV cache has {kv.pool.num_blocks} blocks of {kv.block_size} tokens, fewer than "
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
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # 1. Running requests, oldest first; the youngest are preempted for them.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._will_finish(request):
                i += 1  # its last token is still on the device: nothing more to compute
                continue
            num_new = min(
                request.num_tokens + request.num_pending_tokens - request.num_computed_tokens,
                self.config.prefill_chunk_size,
                budget,
            )
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # 2. Waiting requests, in arrival order, unless this step already preempted.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not out.preempted_request_ids
        ):
            request = self.waiting[0]
            hit = self.kv.find_prefix_hit(request)
            num_new = min(
                request.num_tokens + request.num_pending_tokens - hit.num_computed,
                self.config.prefill_chunk_size,
                budget,
            )
            if not self.kv.allocate_slots(request, num_new, hit):
                break  # wait for blocks to come free; FCFS, so nobody overtakes
            self.waiting.popleft()
            request.num_computed_tokens = hit.num_computed
            request.replay_until = hit.num_tokens if hit.is_replay else 0
            request.sliding_floor = hit.num_computed if hit.is_replay else 0
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            if hit.state is not None:
                out.state_loads.append(
                    StateLoad(request.request_id, hit.state, self.kv.state_block_ids(request.request_id, hit.state))
                )
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        for request, num_new in scheduled:
            chunk = self._make_chunk(request, num_new, out)
            out.chunks.append(chunk)
            request.num_computed_tokens += num_new
            if chunk.sample:
                request.num_pending_tokens += 1
        return out

    def _will_finish(self, request: Request) -> bool:
        """A request whose pending tokens already reach its length limit."""
        if not request.num_pending_tokens:
            return False
        limit = min(request.sampling_params.max_tokens, self.config.max_model_len - request.num_prompt_tokens)
        return request.num_output_tokens + request.num_pending_tokens >= limit

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Append each request's sampled tokens (one per step today; speculative
        decoding will bring several) until one stops it; returns the requests that
        received tokens, with those tokens (finished requests included)."""
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
            updated.append((request, accepted))
        return updated

    # -- internals -----------------------------------------------------------

    def _make_chunk(self, request: Request, num_new: int, out: SchedulerOutput) -> ScheduledChunk:
        if request.request_id not in self._seen_by_runner:
            self._seen_by_runner.add(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.eos_token_ids,
                    list(request.output_token_ids),
                    request.generator_state,
                )
            )
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        token_ids += [PLACEHOLDER] * (num_new - len(token_ids))
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens + request.num_pending_tokens,
            replay_until=request.replay_until,
            sliding_floor=request.sliding_floor,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request, save_state=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.replay_until = request.sliding_floor = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        save = self.kv.free(request)
        if save is not None:
            self.state_saves.append(save)
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)
