"""Logprobs in each API's format: the legacy completions one, vLLM's prompt_logprobs,
and chat's. Values are floored at vLLM's -9999: -inf is not valid JSON and clients
choke on it."""

from collections.abc import Callable, Sequence

from services.balancer.frontend.response_bodies import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from shared.engine.outputs import TokenLogprobs

_MIN_LOGPROB = -9999.0


TokenText = Callable[[int], str]
"""The text of one token id on its own (special tokens included)."""


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def completion_logprobs(
    entries: Sequence[TokenLogprobs | int], token_text: TokenText, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions format; text_offset is where the first token's text
    starts in the output. Returns the logprobs and the offset after the last token.
    top_logprobs holds the k most likely tokens and the sampled one, as OpenAI's.
    A bare token id (the prompt's first, echoed) has no logprob: None, as vLLM's."""
    out = CompletionLogprobs()
    for entry in entries:
        if isinstance(entry, int):
            token = token_text(entry)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token = token_text(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(_logprob(entry.logprob))
            top = {token_text(token_id): _logprob(lp) for token_id, lp in entry.top}
            top.setdefault(token, _logprob(entry.logprob))
            out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], token_text: TokenText) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else its own
    logprob and rank with the top alternatives, keyed by token id."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {token_id: PromptLogprob(logprob=_logprob(lp), rank=rank, decoded_token=token_text(token_id))
                  for rank, (token_id, lp) in enumerate(entry.top, start=1)}
        ranked.setdefault(entry.token_id, PromptLogprob(
            logprob=_logprob(entry.logprob), rank=entry.rank, decoded_token=token_text(entry.token_id)))
        out.append({entry.token_id: ranked.pop(entry.token_id), **ranked})
    return out


def _top_logprob(token_id: int, logprob: float, token_text: TokenText) -> TopLogprob:
    token = token_text(token_id)
    return TopLogprob(token=token, logprob=_logprob(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText) -> ChatLogprobs:
    """The chat format: one entry per token with its top_logprobs alternatives."""
    content = []
    for entry in entries:
        chosen = _top_logprob(entry.token_id, entry.logprob, token_text)
        top = [_top_logprob(token_id, lp, token_text) for token_id, lp in entry.top]
        content.append(ChatLogprobEntry(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


