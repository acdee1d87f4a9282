"""Verification of one request's drafted tokens against the target's logits, as
the sampler would have sampled them (the model runner calls this per request).

The rows are the target's logits at the request's last known token and at each
drafted token. Constraints (logit_bias, allowed_token_ids) apply per row as in
normal sampling; penalties, min_tokens and bad words read the output so far,
which differs at every drafted position, so the engine does not draft for such
requests (a counted fallback).

Every drafter here proposes deterministically (prompt lookup, or the draft model's
argmax), so its proposal distribution is one-hot. For such a proposal, rejection
sampling is the same as drawing each row's token exactly as the sampler would
(greedy: the argmax; sampled: the keyed race at that row's sequence position) and
accepting drafted tokens while they equal the draws: a drafted x passes with
probability p(x), and on a rejection the draw is distributed as p without x, which
is the residual. So a seeded request's tokens with speculation on are the very
tokens it gets with speculation off, and as reproducible (keyed_random.py).
"""

import torch

from shared.engine.sampler import Sampler, SamplingState
from shared.engine.spec.rejection import Verified


def verify_request(
    logits: torch.Tensor, draft: list[int], state: SamplingState, sampler: Sampler, first_position: int
) -> Verified:
    """logits [len(draft) + 1, vocab]: row i samples the token at sequence position
    first_position + i. Returns the accepted run and the token after it."""
    return verify_batch(logits, [draft], [state], sampler, [first_position])[0]


def verify_batch(
    logits: torch.Tensor,
    drafts: list[list[int]],
    states: list[SamplingState],
    sampler: Sampler,
    first_positions: list[int],
) -> list[Verified]:
    """verify_request for several requests at once: logits holds each request's
    len(draft) + 1 rows in turn. Every row is drawn by one sampler call and read back
    once: the sampler treats rows independently (a row's draw depends on its logits,
    its request's parameters and seed, and its position), so the draws are those of
    a call per request, which cost a read-back each."""
    row_states: list[SamplingState] = []
    positions: list[int] = []
    for draft, state, first in zip(drafts, states, first_positions, strict=True):
        if state.params.needs_output_history:
            raise ValueError("drafted tokens of a request with penalties, min_tokens or bad words cannot be verified")
        row_states += [state] * (len(draft) + 1)
        positions += range(first, first + len(draft) + 1)
    drawn: list[int] = sampler.sample_tokens(logits, row_states, positions).tolist()
    verified: list[Verified] = []
    row = 0
    for draft in drafts:
        accepted = 0
        while accepted < len(draft) and draft[accepted] == drawn[row + accepted]:
            accepted += 1
        verified.append(Verified(accepted, [*draft[:accepted], drawn[row + accepted]]))
        row += len(draft) + 1
    return verified
