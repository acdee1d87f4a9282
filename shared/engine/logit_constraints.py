"""What a request allows or forbids on the logits before anything else reads them:
allowed_token_ids, logit_bias and bad words (vLLM's order: the allowed set, then
bad words, then the bias). Pure torch, used by the sampler; the logprobs it
reports stay those of the raw logits (vLLM's default)."""

from collections.abc import Sequence
from typing import Protocol

import torch

from shared.engine.sampling_params import SamplingParams
from shared.engine.step_inputs import to_device


class _Constrained(Protocol):
    params: SamplingParams
    output_token_ids: list[int]


def _constrains(params: SamplingParams) -> bool:
    return params.allowed_token_ids is not None or bool(params.logit_bias) or bool(params.bad_words_token_ids)


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """The tokens that would complete a bad word: a word's last token wherever the
    output ends with the word's other tokens (a one-token word is always banned)."""
    banned: set[int] = set()
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == list(prefix):
            banned.add(word[-1])
    return banned


def apply_constraints(logits: torch.Tensor, states: Sequence[_Constrained]) -> torch.Tensor:
    """logits [rows, vocab] with each row's constraints applied; logits itself (no
    copy) when no row has any. Ids past the logits' width are ignored (the engine
    refuses them at admission; the tokenizer's vocabulary may be wider)."""
    rows = [i for i, s in enumerate(states) if _constrains(s.params)]
    if not rows:
        return logits
    vocab, device = logits.size(1), logits.device
    x = logits.clone()
    for i in rows:
        params = states[i].params
        if params.allowed_token_ids is not None:
            allowed = to_device([t for t in params.allowed_token_ids if t < vocab], torch.long, device)
            keep = x[i, allowed]
            x[i].fill_(float("-inf"))
            x[i, allowed] = keep
        if params.bad_words_token_ids:
            banned = [t for t in banned_by_bad_words(params.bad_words_token_ids, states[i].output_token_ids) if t < vocab]
            if banned:
                x[i, to_device(banned, torch.long, device)] = float("-inf")
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            if ids:
                bias = to_device([params.logit_bias[t] for t in ids], x.dtype, device)
                x[i, to_device(ids, torch.long, device)] += bias
    return x
