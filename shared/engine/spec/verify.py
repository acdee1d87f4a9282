"""Verification of one request's drafted tokens against the target's logits, as
the sampler would have sampled them (the model runner calls this per request).

The rows are the target's logits at the request's last known token and at each
drafted token. Constraints (logit_bias, allowed_token_ids) apply per row as in
normal sampling. Penalties read the output so far, which differs at every drafted
position: each row is penalised with the output as it would be had the drafted
tokens before it been accepted (the tokens it sees are exactly those plain decoding
would have, up to the first rejection, and no row after that is used). min_tokens
and bad words read the output too; the engine does not draft for such requests (a
counted fallback). Logprobs need no history: each emitted token's logprobs come
from its own row, as the sampler computes them (emitted_logprobs).

Every drafter here proposes deterministically (prompt lookup, or the draft model's
argmax), so its proposal distribution is one-hot. For such a proposal, rejection
sampling is the same as drawing each row's token exactly as the sampler would
(greedy: the argmax; sampled: the keyed race at that row's sequence position) and
accepting drafted tokens while they equal the draws: a drafted x passes with
probability p(x), and on a rejection the draw is distributed as p without x, which
is the residual. So a seeded request's tokens with speculation on are the very
tokens it gets with speculation off, and as reproducible (keyed_random.py).
"""

from dataclasses import replace

import torch

from shared.engine.outputs import TokenLogprobs
from shared.engine.sampler import Sampler, SamplingState, logprob_tensors
from shared.engine.spec.rejection import Verified
from shared.engine.step_inputs import to_device


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
        if state.params.masks_by_output:
            raise ValueError("drafted tokens of a request with min_tokens or bad words cannot be verified")
        row_states += _row_states(state, draft, sampler)
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


def _row_states(state: SamplingState, draft: list[int], sampler: Sampler) -> list[SamplingState]:
    """The state each of the request's len(draft) + 1 rows samples with: the request's
    own, or with penalties, views of it whose output holds the drafted tokens before the
    row, so that row i's counts are those plain decoding would have after accepting them."""
    if not state.params.penalised:
        return [state] * (len(draft) + 1)
    if not state.params.greedy:
        sampler.seed_of(state)  # assigned once, on the request's state: every row draws with it
    return [state, *(replace(state, output_token_ids=state.output_token_ids + draft[:i])
                     for i in range(1, len(draft) + 1))]  # fmt: skip


def emitted_logprobs(
    logits: torch.Tensor, drafts: list[list[int]], states: list[SamplingState], verified: list[Verified]
) -> list[list[TokenLogprobs] | None]:
    """Per verified request (as verify_batch's arguments and result), the logprobs of
    each token it emits, or None where it asked for none. The rows are those verify_batch
    drew from (a grammar's mask applied, nothing else): the emitted token i is row i's, so
    logprob_tensors sees it as the sampler sees a plain step's token and its row, raw
    logits before constraints, penalties and temperature. One computation and one
    read-back for all the step's wanted rows."""
    rows: list[int] = []
    row_states: list[SamplingState] = []
    tokens: list[int] = []
    first = 0
    for draft, state, v in zip(drafts, states, verified, strict=True):
        if state.params.logprobs is not None:
            rows += range(first, first + len(v.tokens))
            row_states += [state] * len(v.tokens)
            tokens += v.tokens
        first += len(draft) + 1
    out: list[list[TokenLogprobs] | None] = [None] * len(states)
    if not rows:
        return out
    picked = logits.index_select(0, to_device(rows, torch.long, logits.device))
    wanted = logprob_tensors(picked, row_states, to_device(tokens, torch.long, logits.device))
    assert wanted is not None  # every picked row's request asked
    flat = wanted.unpack(tokens)
    at = 0
    for j, (state, v) in enumerate(zip(states, verified)):
        if state.params.logprobs is not None:
            out[j] = [lp for lp in flat[at : at + len(v.tokens)] if lp is not None]
            at += len(v.tokens)
    return out
