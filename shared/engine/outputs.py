"""What the engine hands out per token and what crosses a process boundary with
it (the mesh's TokenChunk, the balancer's OpenAI logprobs). Plain data, no
torch: the balancer imports these without loading the engine."""

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int
    """1 = most likely; ties count against the token (vLLM's >= convention)."""
    top: list[tuple[int, float]]
    """The params.logprobs most likely (token_id, logprob), best first."""
