"""Per-request sampling settings, validated where they enter the engine."""

import math
from dataclasses import dataclass, field

from shared.engine.structured.spec import StructuredSpec

# The widths these values have on the wire (mesh.proto's SamplingParams): a value
# past them would fail deep in the mesh instead of here.
_TOKEN_ID_LIMIT = 1 << 32
"""Token ids and top_k are uint32."""
_SEED_LIMIT = 1 << 63
"""A seed is a uint64 on the wire and an int64 to torch: [0, 2**63) is both."""
MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs may list (OpenAI's limit)."""
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a logit_bias value (the HTTP layer clamps to it, as vLLM does)."""


class InvalidParam(ValueError):
    """A request parameter the engine refuses: which one (param) and why (message, a
    sentence that starts with its name). A ValueError, for callers that need only that."""

    def __init__(self, param: str, why: str) -> None:
        self.param = param
        self.message = f"{param} {why}"
        super().__init__(self.message)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate (the prompt does not count)."""
    min_tokens: int = 0
    """Fewest tokens to generate before EOS or a stop token may end the request."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p."""
    top_k: int | None = None
    """Keep only the k most likely tokens; None keeps all, and so does a k past the vocabulary."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    repetition_penalty: float = 1.0
    """HF-style: divide positive / multiply negative logits of every token seen in prompt or output."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtract once from every token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtract per occurrence of every token already generated."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the stop string itself is not returned (unless include_stop_str_in_output)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation, besides EOS."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks); stop strings and stop_token_ids still apply."""
    logprobs: int | None = None
    """None: no logprobs. k >= 0: the sampled token's logprob plus the k most likely alternatives."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the token's logit before sampling (OpenAI's logit_bias), in
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; logprobs stay those of the raw logits."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (vLLM's); None allows every token."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """Token sequences that must not appear in the output (vLLM's bad_words,
    tokenized): the last token of each is banned where the output ends with the rest."""
    prompt_logprobs: int | None = None
    """None: none. k >= 0: every prompt token's logprob (the first has none) plus
    the k most likely alternatives at its position. The prompt is then computed
    in full, without prefix-cache hits, as vLLM does."""
    structured: StructuredSpec | None = None
    """The grammar every output token must follow (structured outputs: JSON schema,
    regex, choice, EBNF); None leaves the output free."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in _FLOAT_FIELDS:  # NaN passes every comparison below
            if not math.isfinite(getattr(self, name)):
                raise InvalidParam(name, f"must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise InvalidParam("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and not 1 <= self.top_k < _TOKEN_ID_LIMIT:
            raise InvalidParam("top_k", f"must be None or in [1, 2**32), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidParam("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParam("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        bad_ids = [t for t in self.stop_token_ids if not 0 <= t < _TOKEN_ID_LIMIT]
        if bad_ids:
            raise InvalidParam("stop_token_ids", f"must be token ids in [0, 2**32), got {bad_ids[0]}")
        if self.seed is not None and not 0 <= self.seed < _SEED_LIMIT:
            raise InvalidParam("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "strings must be non-empty")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidParam("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        for token, bias in self.logit_bias.items():
            if not 0 <= token < _TOKEN_ID_LIMIT:
                raise InvalidParam("logit_bias", f"keys must be token ids in [0, 2**32), got {token}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidParam("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidParam("allowed_token_ids", "must not be empty (leave it out to allow every token)")
            if any(not 0 <= t < _TOKEN_ID_LIMIT for t in self.allowed_token_ids):
                raise InvalidParam("allowed_token_ids", "must be token ids in [0, 2**32)")
        if any(not word or any(not 0 <= t < _TOKEN_ID_LIMIT for t in word) for word in self.bad_words_token_ids):
            raise InvalidParam("bad_words_token_ids", "must be non-empty lists of token ids in [0, 2**32)")
        if self.structured is not None and self.min_tokens:
            # The grammar decides where the output ends: holding back EOS could leave no token allowed.
            raise InvalidParam("min_tokens", "cannot be used with structured outputs (the grammar decides the length)")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model: InvalidParam naming the field."""
        named = (
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", [t for word in self.bad_words_token_ids for t in word]),
        )
        for name, ids in named:
            past = [t for t in ids if t >= vocab_size]
            if past:
                raise InvalidParam(name, f"names token ids past the vocabulary ({vocab_size} tokens): {past[:5]}")

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling reads the output so far on the host (penalties, min_tokens,
        bad words), so an overlapped engine cannot sample before the last token is back."""
        return self.penalised or self.masks_by_output

    @property
    def penalised(self) -> bool:
        """Repetition, presence or frequency penalties: they count the output's tokens
        (which the device can do for a token still in flight, sampler.py)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def masks_by_output(self) -> bool:
        """min_tokens or bad words: tokens masked by what the output holds so far, read
        on the host (no speculation; an overlapped step samples them once the step before
        is read back: masked_by_host)."""
        return self.min_tokens > 0 or bool(self.bad_words_token_ids)

    @property
    def masked_by_host(self) -> bool:
        """A structured output, min_tokens or bad words: the mask of the next token is
        made on the host from the output's last token (a grammar's matcher accepts it).
        An overlapped step with such a row launches its forward at once and samples once
        the step before has been read back (ModelRunner.launch, then .sample)."""
        return self.structured is not None or self.masks_by_output

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
