"""The step contract: what the scheduler hands the model runner each step (the
whole contract between them, as vLLM's SchedulerOutput). Plain lists, no tensors."""

from dataclasses import dataclass, field

from shared.engine.prompt_images import PromptImages
from shared.engine.sampling_params import SamplingParams
from shared.kv.memory.state_cache import SlidingState

PLACEHOLDER = -1
"""An input token not known on the host yet: the runner takes it from the
tokens the previous step sampled on the device."""


@dataclass(slots=True)
class NewRequestData:
    """Sent to the runner once per request, the first time it is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    output_token_ids: list[int]
    """Tokens generated before this engine saw the request (a prefill handoff)."""
    images: PromptImages | None = None
    """A prompt with images: the runner's step positions and image rows come from it
    (their embeddings reach the runner beside the step, ModelRunner.add_images)."""


@dataclass(slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]
    """The input tokens of this step, at positions start_pos, start_pos + 1, ..."""
    start_pos: int
    block_ids: list[list[int]]
    """The request's whole block table, one per KV cache group."""
    sample: bool
    """Whether this chunk reaches the request's last known token, so a new token is sampled."""
    replay_until: int = 0
    """Positions below this already have their persistent groups' KV (an SWA replay):
    the step writes only sliding-window KV for them."""
    sliding_floor: int = 0
    """Sliding-window layers see no key before this position (the replay's start)."""
    spec_token_ids: tuple[int, ...] = ()
    """Drafted tokens to verify (speculative decoding): the chunk's last len(spec_token_ids)
    input tokens. The runner samples at each of them and at the token before them, and
    reports how many passed; the scheduler rolls the rejected ones back."""


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished since the last step: the runner drops their state."""
    preempted_request_ids: set[str] = field(default_factory=set)
    state_loads: list["StateLoad"] = field(default_factory=list)
    """Saved sliding-window states to copy into their blocks before the step runs."""
    pad_forward: bool = False
    """Data-parallel attention: this rank has no chunk this step but another rank has, so
    it runs a one-token forward into its null blocks: every MoE layer's all-to-all needs
    every rank (DeepSeek's, vLLM's and SGLang's dummy batch). Its output is dropped."""
    ranks: list["SchedulerOutput"] = field(default_factory=list)
    """Data-parallel attention: each rank's own step, in rank order (their lists, joined,
    are this step's lists, which the engine reads); empty with one scheduler."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class StateLoad:
    request_id: str
    state: SlidingState
    block_ids: dict[int, list[int]]
    """Per sliding group, the blocks the state goes into."""
