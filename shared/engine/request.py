"""A request's state inside the engine: what the scheduler and the KV cache
manager read and update. No tensors here."""

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shared.engine.prompt_images import PromptImages
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockHash, ImageSpan
from shared.kv.transfer import KVTransferParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    """Blocks are reserved and the KV connector is loading them."""
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    """Its grammar compiles on the engine's compile pool (structured outputs): the
    scheduler passes it over until the compile is done."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason for a finished request."""
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    images: PromptImages | None = None
    """A prompt with images: where their tokens are, their names, the M-RoPE positions."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (or being computed by the step in flight)."""
    replay_until: int = 0
    """A request resumed by SWA replay: below this position its persistent groups' KV
    is cached, and the steps that recompute those tokens write sliding-window KV only."""
    sliding_floor: int = 0
    """The first position whose sliding-window KV exists (the replay's start), so
    sliding-window queries never see a key before it."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache at first admission (usage.cached_tokens)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chain hashes of the full blocks of all_token_ids, extended as tokens arrive."""
    num_preemptions: int = 0
    num_pending_tokens: int = 0
    """Tokens sampled by a step still running on the device (an overlapped
    engine schedules the next step before reading them back)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the request, if any."""
    kv_transfer: KVTransferParams | None = None
    trace_carrier: dict[str, str] | None = None
    kv_lookup_done: bool = False
    """The connector has answered (or was not asked): admission does not ask again."""
    num_external_blocks: int = 0
    """Leading blocks the connector's source held at lookup: a save skips them."""
    kv_awaits_room: bool = False
    """Its load found no free blocks to land in: it waits at the head of the queue for
    them (Scheduler._kv_wait), the lookup's answer kept."""
    num_loaded_blocks: int = 0
    num_replayed_tokens: int = 0
    """Tokens recomputed at admission to rebuild sliding-window KV (SWA replay)."""
    kv_loaded_direct: bool = False
    """The load was a direct copy from a peer's cache."""
    kv_load_path: str = ""
    """Where the loaded blocks came from (LoadResult.path); "" when nothing was loaded."""
    kv_load_plane: str = ""
    """How a kvcache load's bytes came (LoadResult.plane); "" otherwise."""
    kv_load_failed: bool = False
    """A load the connector promised did not (fully) arrive: those tokens were recomputed."""
    kv_load_seconds: float = 0.0
    """From asking the connector for the blocks to their arrival in the cache."""
    kv_copy_seconds: float = 0.0
    """Of that, the direct copy's own time (LoadResult.copy_seconds)."""
    first_scheduled_time: float | None = None
    """time.monotonic() when a step first took the request (its queue time ends there)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Drafted tokens the engine proposes to verify in the next step (speculative
    decoding); the scheduler may take fewer (budget, length limits). Not part of
    all_token_ids: nothing is hashed or indexed for them until verification accepts."""
    num_spec_drafted_tokens: int = 0
    """Drafted tokens of this request verified so far (speculative decoding)."""
    num_spec_accepted_tokens: int = 0
    grammar: "Future[Any] | None" = None
    """The compile of its grammar while in WAITING_FOR_GRAMMAR (the engine's compile pool)."""

    @property
    def grammar_ready(self) -> bool:
        """Whether the request may be scheduled as far as its grammar goes: none to wait
        for, or compiled (a failed compile is not ready: the engine ends the request)."""
        g = self.grammar
        return g is None or (g.done() and not g.cancelled() and g.exception() is None)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        # One list for prompt + output so reading all tokens never copies.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def image_spans(self) -> tuple[ImageSpan, ...]:
        """The prompt's image runs, whose (hash, offset) the block hashes carry."""
        return self.images.spans if self.images is not None else ()

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a token was appended: the finished status, if this token ends it."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
