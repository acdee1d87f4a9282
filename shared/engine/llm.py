"""Offline generation: give prompts, get completions (what DeepInfer itself ships)."""

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest, RequestImages
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import TokenLogprobs
from shared.engine.images import content_hashes
from shared.engine.sampling_params import SamplingParams
from shared.model.multimodal import ImageInputs


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | EngineConfig, *, load_progress: bool = False, **engine_settings: Any) -> None:
        """model: a checkpoint folder or a whole EngineConfig; engine_settings:
        EngineConfig fields over it, e.g. LLM("models/tiny", block_size=8)."""
        config = model if isinstance(model, EngineConfig) else EngineConfig(model=model)
        self.engine = LLMEngine(dataclasses.replace(config, **engine_settings), load_progress=load_progress)
        self._ids = itertools.count()

    @property
    def recipe(self):  # noqa: ANN201 - the engine's Recipe
        return self.engine.recipe

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        images: Sequence[ImageInputs | RequestImages | None] | None = None,
    ) -> list[CompletionOutput]:
        """Run all prompts as one continuous batch; results in prompt order. images: per
        prompt, its images as the model's image processor gives them (ImageInputs, named
        by their content) or with their names (RequestImages); the prompt holds each
        image's placeholder tokens where it goes."""
        if params is None:
            params = SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        per_images = list(images) if images is not None else [None] * len(prompts)
        if len(per_images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_images)} entries of images")
        results: dict[str, CompletionOutput] = {}
        order: list[str] = []
        try:
            for prompt, p, given in zip(prompts, per_prompt, per_images):
                rid = str(next(self._ids))
                prompt_ids = self.engine.add_request(EngineRequest(rid, prompt, p, images=_named(given)))
                results[rid] = CompletionOutput(rid, prompt_ids)
                order.append(rid)
        except ValueError:
            for rid in order:  # all or nothing: a bad prompt leaves no orphans behind
                self.engine.abort_request(rid)
            raise
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                done = results[out.request_id]
                done.logprobs += out.new_logprobs
                if out.finished:
                    done.text = out.text
                    done.token_ids = list(out.token_ids)
                    done.finish_reason = out.finish_reason
                    done.stop_reason = out.stop_reason
                    done.num_cached_tokens = out.num_cached_tokens
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def chat(
        self,
        conversations: list[list[dict[str, str]]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        if self.recipe is None:
            raise ValueError("chat needs a tokenizer with a chat template; this checkpoint has none")
        prompts: list[str | list[int]] = [self.recipe.encode_chat(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)


def _named(images: ImageInputs | RequestImages | None) -> RequestImages | None:
    if images is None or isinstance(images, RequestImages):
        return images
    return RequestImages(images, content_hashes(images))
