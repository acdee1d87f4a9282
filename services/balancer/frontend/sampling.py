"""A completions or chat body's token-level settings as the engine's SamplingParams.
Stop strings stay with the HTTP layer (the detokenizer matches them)."""

from services.balancer.frontend.request_bodies import GenerationBody
from services.balancer.frontend.structured_outputs import structured_spec
from shared.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams


def sampling_params(
    body: GenerationBody, max_tokens: int, logprobs: int | None, bad_words_token_ids: list[list[int]] | None = None
) -> SamplingParams:
    """Raises SamplingParams' InvalidParam (param, message) for values out of range,
    APIError for conflicting structured-output fields."""
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=None if body.top_k in (None, 0, -1) else body.top_k,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_token_ids=list(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        seed=body.seed,
        skip_special_tokens=body.skip_special_tokens,
        logit_bias={int(k): min(max(v, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS) for k, v in (body.logit_bias or {}).items()},
        allowed_token_ids=list(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
        bad_words_token_ids=bad_words_token_ids or [],
        prompt_logprobs=body.prompt_logprobs,
        structured=structured_spec(body),
    )
