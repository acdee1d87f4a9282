"""Qwen3-VL through the whole engine (LLM.generate: scheduler, paged cache, runner)
against transformers' generate on a tiny seeded model: greedy tokens and every step's
logprob for prompts of 0, 1, 2 and 4 images batched in one continuous batch (sync and
overlapped steps), and chunked prefill whose chunks cut images (each chunk's image
rows carry their deepstack columns)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.engine.llm import LLM, CompletionOutput
from shared.engine.sampling_params import SamplingParams
from shared.model.multimodal import ImageInputs
from tests.helpers.vlm_models import (
    VLPrompt, hf_inputs, hf_qwen3_vl_model, qwen3_image_processor, save_tiny_qwen3_vl_model, synthetic_images,
    vl_prompt,
)  # fmt: skip

pytest.importorskip("transformers")

NUM_NEW = 8
LOGPROB_TOLERANCE = 1e-4
IMAGE_SIZES = [(128, 192), (160, 96), (64, 64), (200, 150)]
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=0)


@dataclass
class Case:
    prompt: VLPrompt
    greedy: list[int]
    chosen: list[float]
    """transformers' log-probability of each greedy token."""

    @property
    def images(self) -> ImageInputs | None:
        p = self.prompt
        return None if p.pixel_values is None else ImageInputs.from_processor(p.pixel_values, p.image_grid_thw)


@dataclass
class Fixture:
    path: Path
    cases: dict[int, Case]


def _reference(hf: Any, prompt: VLPrompt) -> Case:
    with torch.no_grad():
        out = hf.generate(**hf_inputs(prompt), max_new_tokens=NUM_NEW, do_sample=False)
        greedy = out[0, len(prompt.token_ids) :].tolist()
        logits = hf(**hf_inputs(prompt, greedy)).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(prompt.token_ids)
    return Case(prompt, greedy, [float(logprobs[n - 1 + i, t]) for i, t in enumerate(greedy)])


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    path = save_tiny_qwen3_vl_model(tmp_path_factory.mktemp("qwen3_vl_engine"), seed=1)
    hf = hf_qwen3_vl_model(path)
    images = synthetic_images(IMAGE_SIZES, seed=3)
    processor = qwen3_image_processor()
    cases = {n: _reference(hf, vl_prompt(images[:n], seed=20 + n, processor=processor)) for n in (0, 1, 2, 4)}
    return Fixture(path, cases)


def _check(out: CompletionOutput, case: Case) -> None:
    assert out.token_ids == case.greedy
    got = [lp.logprob for lp in out.logprobs]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(case.chosen), rtol=0, atol=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_images_batched_equal_transformers(vl: Fixture, overlap: bool) -> None:
    """0, 1, 2 and 4 images in one continuous batch, chunks small enough that decode
    steps mix with prefill chunks."""
    llm = LLM(str(vl.path), block_size=4, prefill_chunk_size=16, max_num_batched_tokens=64, async_scheduling=overlap)
    order = [0, 1, 2, 4]
    outs = llm.generate([vl.cases[k].prompt.token_ids for k in order], PARAMS, images=[vl.cases[k].images for k in order])
    for out, key in zip(outs, order):
        _check(out, vl.cases[key])
    assert not llm.engine.runner.image_embeds and not llm.engine.runner.prompt_images  # dropped at the finish


def test_chunked_prefill_cutting_images_equals_transformers(vl: Fixture) -> None:
    """The 2-image prompt alone in steps of 5 tokens: steps begin and end inside its images."""
    case = vl.cases[2]
    llm = LLM(str(vl.path), block_size=4, max_num_batched_tokens=5, prefill_chunk_size=5)
    _check(llm.generate([case.prompt.token_ids], PARAMS, images=[case.images])[0], case)
