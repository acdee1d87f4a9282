"""A checked request body as the jobs the mesh runs: per prompt (truncated, checked
against the context length and, for prompt logprobs, the mesh's message bound), num_samples generations,
each with its SamplingParams, detokenizer and request id."""

import uuid

from fastapi import Request

from services.balancer.frontend import protocol as p
from services.balancer.frontend.choices import Call, Job
from services.balancer.frontend.errors import APIError
from services.balancer.generation import GenerationRequest
from services.balancer.frontend.seeds import draw_seed
from shared.engine.sampling_params import InvalidParam
from shared.multimodal.image import LoadedImage
from shared.recipe import Recipe
from shared.runtime.bus_parts import MAX_MESSAGE_BYTES

MAX_PROMPT_LOGPROB_BYTES = MAX_MESSAGE_BYTES // 2
"""Prompt logprobs cross NATS in prefill's handoff and decode's first chunk, beside the
prompt: in parts when long (shared/runtime/bus_parts.py), half a message's bound at most."""


def _prompt_logprob_bytes(num_prompt: int, k: int) -> int:
    """A bound on the wire size of num_prompt TokenLogprobs with k + 1 entries each."""
    return num_prompt * (24 + 9 * (k + 1))


class JobPlanner:
    def __init__(self, recipe: Recipe, model_name: str, max_model_len: int) -> None:
        self.recipe = recipe
        self.model_name = model_name
        self.max_model_len = max_model_len

    def plan(
        self,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        http: Request,
        prompts: list[list[int]],
        chat: bool,
        what: str,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_k: int | None,
        keep_special_tokens: bool = False,
        images: list[LoadedImage] | None = None,
    ) -> Call:
        """The jobs of one request: per prompt, num_samples generations (seed + i each,
        the first alone scoring the prompt when prompt logprobs are asked). A body
        without a seed gets one drawn (seeds.py), so every output can be reproduced."""
        limit = self.max_model_len
        prompts = [self._truncate(ids, body.truncate_prompt_tokens) for ids in prompts]
        bad_words = self._bad_words(body.bad_words) if body.bad_words else None
        num_samples = body.num_samples
        # best_of ranks samples by their cumulative logprob: ask for it even if the client did not.
        mesh_logprobs = logprobs if logprobs is not None or num_samples == (body.n or 1) else 0
        named = body.request_id or _header_id(http)
        call_id = f"{'chatcmpl' if chat else 'cmpl'}-{named or uuid.uuid4().hex}"
        # The mesh's ids are ours: unique, and safe as NATS subject tokens (a client's id need be neither).
        internal = call_id if named is None and len(prompts) * num_samples == 1 else None
        jobs: list[Job] = []
        seed = body.seed if body.seed is not None else draw_seed()
        for prompt_index, prompt_ids in enumerate(prompts):
            num_prompt = len(prompt_ids)
            if num_prompt == 0:
                raise APIError(400, f"The {what} is empty.", param=what)
            if num_prompt >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{num_prompt} input tokens. Please reduce the length of the {what}.",
                    param=what,
                )
            if max_tokens is not None and num_prompt + max_tokens > limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the completion). "
                    f"Please reduce the length of the {what} or completion.",
                    param="max_tokens",
                )
            if prompt_k is not None and _prompt_logprob_bytes(num_prompt, prompt_k) > MAX_PROMPT_LOGPROB_BYTES:
                param = "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"
                raise APIError(400, f"{param}: the prompt's logprobs ({num_prompt} tokens with {prompt_k} "
                               "alternatives each) would pass the mesh's message bound; score a shorter prompt "
                               "or ask for fewer alternatives", param=param)
            first: Job | None = None
            for sample in range(num_samples):
                try:
                    params = p.sampling_params(
                        body, limit - num_prompt if max_tokens is None else max_tokens, mesh_logprobs, bad_words
                    )
                    params.seed = seed + sample
                    if sample:
                        params.prompt_logprobs = None  # the prompt's first sample scores it for all
                    else:
                        params.prompt_logprobs = prompt_k
                    params.__post_init__()  # the seed moved
                    detokenizer = self.recipe.detokenizer(
                        prompt_ids,
                        # A tool format made of special tokens (harmony) is read from them.
                        skip_special_tokens=body.skip_special_tokens and not keep_special_tokens,
                        stop=body.stop_strings,
                        include_stop_str_in_output=body.include_stop_str_in_output,
                    )
                except InvalidParam as exc:
                    raise APIError(400, exc.message, param=exc.param) from exc
                except ValueError as exc:  # the detokenizer's (stop strings): no one field
                    raise APIError(400, str(exc)) from exc
                rid = internal or f"{call_id.split('-', 1)[0]}-{uuid.uuid4().hex}"
                request = GenerationRequest(rid, prompt_ids, params, cache_salt=body.cache_salt, priority=body.priority,
                                            images=list(images or ()))
                job = Job(request, detokenizer, prompt_index, sample, prompt_index * (body.n or 1) + sample, after=first)
                first = first or job
                jobs.append(job)
        return Call(
            call_id, chat, self.model_name, jobs, prompts, body.n or 1, logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            include_usage=body.include_usage, continuous_usage=body.continuous_usage,
            return_token_ids=body.return_token_ids, tokens_as_ids=body.return_tokens_as_token_ids, seed=seed,
        )

    def _truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context length)."""
        if keep is None:
            return prompt_ids
        keep = self.max_model_len if keep == -1 else keep
        if keep == 0:
            raise APIError(400, "truncate_prompt_tokens: must be -1 or at least 1", param="truncate_prompt_tokens")
        return prompt_ids[-keep:]

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone, and after a space when
        that makes other tokens of the same length (a word inside the text)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.recipe.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.recipe.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone:
                raise APIError(400, f"bad_words: {word!r} has no tokens", param="bad_words")
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out


def _header_id(http: Request) -> str | None:
    """The client's X-Request-Id, where it could name a response (vLLM takes it too)."""
    value = http.headers.get("x-request-id")
    if value is None:
        return None
    try:
        return p.check_request_id(value) if len(value) <= p.MAX_REQUEST_ID_CHARS else None
    except ValueError:
        return None
