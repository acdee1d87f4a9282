"""Verification of one request's drafted tokens against the target's logits, as
the sampler would have sampled them (the model runner calls this per request).

The rows are the target's logits at the request's last known token and at each
drafted token. Constraints (logit_bias, allowed_token_ids) apply per row as in
normal sampling; penalties, min_tokens and bad words read the output so far,
which differs at every drafted position, so the engine does not draft for such
requests (a counted fallback). Greedy requests take the argmax test, the others
rejection sampling against the sampler's own distribution (temperature, top-k,
top-p, min-p). Every drafter here proposes deterministically (prompt lookup, or
the draft model's argmax), so its proposal distribution is one-hot: a drafted
token passes with probability p(x), and a rejection resamples p without x.
"""

import torch

from shared.engine.logit_constraints import apply_constraints
from shared.engine.sampler import Sampler, SamplingState, sampling_probs
from shared.engine.spec.rejection import Verified, verify_greedy, verify_sampled


def verify_request(logits: torch.Tensor, draft: list[int], state: SamplingState, sampler: Sampler) -> Verified:
    """logits [len(draft) + 1, vocab]; returns the accepted run and the token after it."""
    if state.params.needs_output_history:
        raise ValueError("drafted tokens of a request with penalties, min_tokens or bad words cannot be verified")
    rows = [state] * logits.shape[0]
    x = apply_constraints(logits.float(), rows)
    if state.params.greedy:
        return verify_greedy(draft, x)
    probs = sampling_probs(x, rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    generator = sampler.generator_for(state, logits.device)
    uniforms = torch.rand(len(draft), generator=generator, device=logits.device)
    proposal = torch.zeros(len(draft), logits.shape[1], device=logits.device)
    if draft:
        proposal[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
    return verify_sampled(draft, proposal, probs, uniforms, generator)
