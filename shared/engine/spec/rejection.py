"""Lossless verification of drafted tokens.

Greedy (temperature 0): a drafted token passes when it is the target's argmax;
the first that does not is replaced by the argmax, and if all pass the target's
next argmax is appended. Output equals decoding without speculation.

Sampled: rejection sampling (Leviathan et al., Chen et al.). Drafted token x_i,
proposed with probability q_i(x_i), passes with probability min(1, p_i(x_i) / q_i(x_i));
the first that fails is replaced by a sample of the residual max(0, p_i − q_i),
normalised; if all pass, a bonus token is sampled from p_{k+1}. Each emitted
token is then distributed exactly as the target's p, whatever the drafter.

The uniforms come from the caller, so that a counter-based generator keyed by
(seed, position) can make sampled speculation reproducible too.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Verified:
    num_accepted: int
    """Leading drafted tokens that passed."""
    tokens: list[int]
    """What the step emits: the accepted drafted tokens, then the correction or bonus token."""


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> Verified:
    """target_logits [len(draft) + 1, vocab]: row i is the target's prediction after
    the context and the first i drafted tokens."""
    _check(draft_tokens, target_logits)
    best = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == best[accepted]:
        accepted += 1
    return Verified(accepted, [*draft_tokens[:accepted], best[accepted]])


def verify_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verified:
    """draft_probs [k, vocab] (q_i; a deterministic drafter's rows are one-hot),
    target_probs [k + 1, vocab] (p_i), uniforms [k] in [0, 1) for the accept tests;
    the replacement or bonus token is drawn with `generator`."""
    _check(draft_tokens, target_probs)
    k = len(draft_tokens)
    if draft_probs.shape != (k, target_probs.shape[1]) or uniforms.shape != (k,):
        raise ValueError(f"draft_probs must be [{k}, vocab] and uniforms [{k}], got "
                         f"{tuple(draft_probs.shape)} and {tuple(uniforms.shape)}")  # fmt: skip
    idx = torch.tensor(draft_tokens, dtype=torch.long)
    rows = torch.arange(k)
    p = target_probs[rows, idx] if k else target_probs.new_zeros(0)
    q = draft_probs[rows, idx] if k else draft_probs.new_zeros(0)
    # u < p/q  <=>  u * q < p  (no division: q may be 0 for a token the drafter "could not" propose)
    passed = (uniforms * q < p).tolist()
    accepted = 0
    while accepted < k and passed[accepted]:
        accepted += 1
    if accepted < k:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        total = residual.sum()
        # A residual of zero mass means p == q on the support: any p-sample is exact.
        dist = residual / total if total > 0 else target_probs[accepted]
    else:
        dist = target_probs[k]
    extra = int(torch.multinomial(dist, 1, generator=generator).item())
    return Verified(accepted, [*draft_tokens[:accepted], extra])


def _check(draft_tokens: list[int], target: torch.Tensor) -> None:
    if target.dim() != 2 or target.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"target rows must be len(draft) + 1 = {len(draft_tokens) + 1}, got {tuple(target.shape)}")
