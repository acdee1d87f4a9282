"""What the engine hands out: per request and step (RequestOutput, with its
logprobs and what the KV connector moved), and its load figures. Plain data, no
torch: the balancer and the services import these without loading the engine."""

from dataclasses import dataclass, field, fields

from shared.kv.block_hash import BlockHash
from shared.kv.transfer import HeldBlocks
from shared.engine.eplb.expert_load import ExpertLoad


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int
    """1 = most likely; ties count against the token (vLLM's >= convention)."""
    top: list[tuple[int, float]]
    """The params.logprobs most likely (token_id, logprob), best first."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """All output tokens so far."""
    new_token_ids: list[int]
    text: str
    """All output text so far, cut at a stop string."""
    delta_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    kv: "KVTransferReport | None" = None
    """On a finished request with KV-transfer parameters: what the connector moved."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the first output of a request with params.prompt_logprobs: per prompt
    token, its logprobs (None for the first token, which nothing predicts)."""
    queued_seconds: float | None = None
    """On a finished request: from its arrival in the engine to the first step that
    took it (vLLM's queue time); None if no step took it."""
    num_spec_drafted_tokens: int = 0
    """Speculative decoding: this request's drafted tokens verified so far, and how
    many of them were accepted (OpenAI's accepted/rejected prediction tokens)."""
    num_spec_accepted_tokens: int = 0


@dataclass(slots=True)
class KVTransferReport:
    block_hashes: list[BlockHash]
    """The chain hashes of the prompt's full blocks, as this engine computed them."""
    num_loaded_blocks: int = 0
    load_failed: bool = False
    """A promised load did not (fully) arrive: those tokens were recomputed."""
    num_saved_blocks: int = 0
    save_error: str | None = None
    num_replayed_tokens: int = 0
    """Tokens recomputed to rebuild sliding-window KV after a hit (SWA replay)."""
    loaded_direct: bool = False
    """The loaded blocks came straight from a peer's cache (not through kvcache)."""
    load_path: str = ""
    """Where the loaded blocks came from (LoadResult.path: "peer", "nixl", "host",
    "kvcache", ...); "" when no load ran."""
    load_plane: str = ""
    """How a kvcache load's bytes came (LoadResult.plane: "shm", "nixl", "stream", or
    several joined by "+"); "" for other loads."""
    load_seconds: float = 0.0
    """From asking the connector for the blocks to their arrival (with num_loaded_blocks,
    the load's effective bandwidth)."""
    copy_seconds: float = 0.0
    """Of load_seconds, a direct copy's own time: the rest waited for the copy thread
    and for the engine's next step, which is when a request can join the batch."""
    held: HeldBlocks | None = None
    """The prompt's blocks held for a peer to copy (KVTransferParams.hold)."""


def queued_prompt_tokens(num_prompt_tokens: int, num_output_tokens: int, recomputing: bool = False) -> int:
    """One request's share of its instance's queued load (Load.num_queued_tokens), the one
    definition the worker's heartbeat and the balancer's reservation both count: its whole
    prompt, cached blocks included, until its first token (its prefill done). A request's
    blocks sit on the instance until then whether computed or found cached: its new tokens
    attend to all of them and decode pulls all of them. Counting only the tokens to compute
    made a holder of a shared 1k-token prefix look idle with six 16-token requests queued
    (6 blocks against the 64 a miss costs elsewhere), and every request went to it.

    recomputing: the request was preempted and has not caught up (its KV was freed, its
    prompt and the tokens it generated are computed again): all of them count, as a prompt
    that long would. Counted as 0 (it has output), a preempting instance looked lighter
    than it was exactly when it had too much to hold."""
    if recomputing:
        return num_prompt_tokens + num_output_tokens
    return num_prompt_tokens if num_output_tokens == 0 else 0


@dataclass(slots=True)
class StepCounts:
    """Since start, the engine's steps that ran a forward, by how they ran: how far
    async scheduling reaches (a request that turns it off for its batch shows here)."""

    overlapped: int = 0
    """Launched before the step before was read back (async scheduling)."""
    sampled_after_read_back: int = 0
    """Of the overlapped, those whose sampling waited for the step before's read-back: a
    row masked by the host (structured output, min_tokens, bad words); the forward did not."""
    synchronous: int = 0
    """Run and read back before the next step was scheduled: async scheduling off, a
    drafting step (speculation), a prompt being scored (prompt_logprobs)."""


STEP_KINDS = tuple(f.name for f in fields(StepCounts))
"""StepCounts' fields: the `how` label of a worker's engine_steps_total."""


@dataclass(slots=True)
class EngineLoad:
    """The load figures a worker reports in its heartbeats."""

    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_queued_tokens: int
    """Prompt tokens of the requests not past their prefill, and all the tokens of the
    preempted ones not recomputed yet (queued_prompt_tokens)."""
    num_kv_save_failures: int = 0
    """Stores through the KV connector that failed since start (written behind or not)."""
    num_kv_saves_dropped: int = 0
    """Stores written behind that were dropped since start: too many in flight."""
    num_preemptions: int = 0
    """Since start."""
    num_prefix_query_tokens: int = 0
    """Since start: tokens of the requests looked up in the prefix cache (vLLM's prefix cache queries)."""
    num_prefix_hit_tokens: int = 0
    """Since start: of those, the tokens found cached (vLLM's prefix cache hits)."""
    num_images_encoded: int = 0
    """Since start: images the vision tower ran on here (none for those a vision instance
    encoded, nor for those whose KV a handoff brought and no step recomputed)."""
    num_running_per_rank: list[int] = field(default_factory=list)
    """Running requests on each data-parallel rank (one entry without data-parallel attention)."""
    tokens_per_expert: list[list[int]] | None = None
    """Per sparse layer, per expert: the (token, choice) pairs routed to it since start,
    over every forward (prefill chunks and replays included), as counted on the device.
    The difference of two loads is the counts between them (expert_load is the
    engine's own window of the last steps). None for a dense model."""
    expert_load: ExpertLoad | None = None
    """An MoE engine's expert load over its window of the last steps (per layer, tokens
    per rank: one rank unless expert-parallel); None for a dense model."""
    num_spec_drafted_tokens: int = 0
    """Since start: drafted tokens verified (speculative decoding)."""
    num_spec_accepted_tokens: int = 0
    """Since start: of those, the tokens accepted."""
    num_spec_verifications: int = 0
    """Since start: (request, step) pairs that verified drafted tokens."""
    spec_accepted_by_position: list[int] | None = None
    """[k]: verifications whose drafted token k + 1 was accepted; None without speculation."""
    spec_fallbacks: dict[str, int] | None = None
    """Since start, by reason: requests (min_tokens, bad_words) or steps (async_scheduling,
    cuda_graphs) that ran without speculation although it is on; None without it."""
    steps: StepCounts = field(default_factory=StepCounts)
    """Since start, the steps by how they ran (overlapped or not)."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted drafted tokens plus the bonus or
        correction token); 0 before any verification."""
        if not self.num_spec_verifications:
            return 0.0
        return (self.num_spec_accepted_tokens + self.num_spec_verifications) / self.num_spec_verifications
