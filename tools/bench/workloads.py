"""What `infermesh bench` sends: sessions of one or more turns, seeded, so two
runs (or two servers) get the same requests.

  random         distinct random prompts (no prefix-cache hit flatters a server);
  shared-prefix  num_prefixes system prompts of prefix_len tokens, each request one
                 of them plus a random suffix (what prefix caching and
                 cache-aware routing are for);
  multi-turn     chat conversations of `turns` user messages, each turn sent with
                 the whole history, the server's own answers included.

Prompts are token ids on /v1/completions (exact lengths, no tokenizer needed;
vLLM, SGLang and InferMesh take them) or, with prompt_format "text" and always
for multi-turn, words (about one token each in most tokenizers)."""

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tools.bench.openai_stream import RequestSpec

WORKLOADS = ("random", "shared-prefix", "multi-turn")
# Common short words: about one token each in most tokenizers.
_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down side"
).split()


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    name: str = "random"
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    """Lengths drawn uniformly in [len * (1 - r), len * (1 + r)] (vLLM's random_range_ratio)."""
    prefix_len: int = 256
    num_prefixes: int = 4
    turns: int = 3
    prompt_format: str = "ids"
    """ids: token-id prompts on /v1/completions; text: words."""
    vocab_range: tuple[int, int] = (10, 1000)
    """Token ids are drawn from this range: within any model's vocabulary."""
    extra_body: dict = field(default_factory=lambda: {"temperature": 0.0, "ignore_eos": True})

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt_format must be ids or text, got {self.prompt_format!r}")
        if min(self.input_len, self.output_len, self.turns, self.num_prefixes) < 1 or self.prefix_len < 0:
            raise ValueError("input_len, output_len, turns and num_prefixes must be at least 1, prefix_len at least 0")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")


Turn = Callable[[list[str]], RequestSpec]
"""A session's next request, given the answers to its earlier turns."""


@dataclass(slots=True)
class Session:
    turns: list[Turn]


def make_sessions(config: WorkloadConfig, num: int, seed: int = 0) -> list[Session]:
    rng = np.random.default_rng(seed)
    if config.name == "multi-turn":
        return [_conversation(config, rng) for _ in range(num)]
    prefixes = [_tokens(config, rng, config.prefix_len) for _ in range(config.num_prefixes)]
    sessions = []
    for i in range(num):
        prefix = prefixes[i % config.num_prefixes] if config.name == "shared-prefix" else []
        prompt = prefix + _tokens(config, rng, _length(config.input_len, config.range_ratio, rng))
        spec = _completion(config, prompt, _length(config.output_len, config.range_ratio, rng))
        sessions.append(Session([lambda answers, spec=spec: spec]))
    return sessions


def _length(mean: int, ratio: float, rng: np.random.Generator) -> int:
    low, high = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return int(rng.integers(low, high + 1))


def _tokens(config: WorkloadConfig, rng: np.random.Generator, n: int) -> list:
    """n token ids, or n words (the list's items are joined later)."""
    if config.prompt_format == "text":
        return [str(w) for w in rng.choice(_WORDS, size=n)]
    return rng.integers(*config.vocab_range, size=n).tolist()


def _completion(config: WorkloadConfig, prompt: list, max_tokens: int) -> RequestSpec:
    body = dict(config.extra_body)
    if config.prompt_format == "text":
        return RequestSpec(prompt=" ".join(prompt), max_tokens=max_tokens, num_prompt_tokens=len(prompt), extra_body=body)
    return RequestSpec(prompt=prompt, max_tokens=max_tokens, num_prompt_tokens=len(prompt), extra_body=body)


def _conversation(config: WorkloadConfig, rng: np.random.Generator) -> Session:
    """Chat turns: each sends the history so far (user messages and the server's answers)."""
    messages = [" ".join(str(w) for w in rng.choice(_WORDS, size=_length(config.input_len, config.range_ratio, rng)))
                for _ in range(config.turns)]  # fmt: skip
    max_tokens = [_length(config.output_len, config.range_ratio, rng) for _ in range(config.turns)]

    def turn(i: int) -> Turn:
        def spec(answers: list[str]) -> RequestSpec:
            history: list[dict[str, str]] = []
            for j in range(i):
                history += [{"role": "user", "content": messages[j]}, {"role": "assistant", "content": answers[j]}]
            history.append({"role": "user", "content": messages[i]})
            return RequestSpec(messages=history, max_tokens=max_tokens[i], extra_body=dict(config.extra_body))

        return spec

    return Session([turn(i) for i in range(config.turns)])
