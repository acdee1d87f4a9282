"""Our Qwen3-VL against transformers', float32, on a tiny seeded model (every weight
random, the tower's position table, biases and deepstack mergers too) with prompts of
0, 1, 2 and 4 synthetic images of different sizes (the position table resampled up and
down, non-square grids): the tower's embeddings and deepstack features, the M-RoPE
positions, and greedy tokens and logprobs over a paged cache (prefill with the
deepstack features added after the first layers, then decode at position + delta),
also with an image cut across chunked-prefill steps."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.model.interface import CausalLM
from shared.model.layers import mrope_axes
from shared.model.multimodal import ImageInputs
from shared.model.vision.mrope import MRopePositions, mrope_positions
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.vlm_models import (
    IMAGE_PAD, VLPrompt, hf_inputs, hf_qwen3_vl_model, qwen3_image_processor, save_tiny_qwen3_vl_model,
    synthetic_images, vl_prompt,
)  # fmt: skip

pytest.importorskip("transformers")

IMAGE_COUNTS = (0, 1, 2, 4)
# (width, height): 8x12 patches (the 6x6 table resampled up), 10x6, 4x4 (the minimum
# area: the table resampled down), 12x10 after the resize to multiples of 32.
IMAGE_SIZES = [(128, 192), (160, 96), (64, 64), (200, 150)]
NUM_NEW = 8
LOGPROB_TOLERANCE = 1e-4


@dataclass
class Case:
    prompt: VLPrompt
    grids: list[tuple[int, int, int]]
    positions: MRopePositions
    greedy: list[int]
    """transformers' generate, greedy."""
    reference: torch.Tensor
    """transformers' log-probabilities [prompt + greedy, vocab], one forward over all of it."""


@dataclass
class Fixture:
    path: Path
    hf: Any
    model: CausalLM
    cases: dict[int, Case]


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    from shared.model.loader import load_model

    path = save_tiny_qwen3_vl_model(tmp_path_factory.mktemp("qwen3_vl"), seed=1)
    hf = hf_qwen3_vl_model(path)
    images = synthetic_images(IMAGE_SIZES, seed=3)
    cases = {}
    for n in IMAGE_COUNTS:
        prompt = vl_prompt(images[:n], seed=4 + n, processor=qwen3_image_processor())
        with torch.no_grad():
            out = hf.generate(**hf_inputs(prompt), max_new_tokens=NUM_NEW, do_sample=False)
            greedy = out[0, len(prompt.token_ids) :].tolist()
            logits = hf(**hf_inputs(prompt, greedy)).logits[0].float()
        grids = [] if prompt.image_grid_thw is None else [tuple(g) for g in prompt.image_grid_thw.tolist()]
        positions = mrope_positions(prompt.token_ids, grids, IMAGE_PAD, 2)
        cases[n] = Case(prompt, grids, positions, greedy, torch.log_softmax(logits, dim=-1))
    return Fixture(path, hf, load_model(path), cases)


def _image_rows(case: Case, model: CausalLM) -> tuple[list[int], torch.Tensor | None]:
    """The prompt's image-pad rows and the tower's rows for them."""
    rows = [i for i, t in enumerate(case.prompt.token_ids) if t == IMAGE_PAD]
    if not rows:
        return rows, None
    assert case.prompt.pixel_values is not None and case.prompt.image_grid_thw is not None
    images = ImageInputs.from_processor(case.prompt.pixel_values, case.prompt.image_grid_thw)
    return rows, torch.cat(model.encode_images(images))  # type: ignore[operator]


def test_interleaved_sections_are_transformers() -> None:
    """Qwen3-VL's default sections (24/20/20 of 64 pairs) and the tiny ones: each pair's
    axis as Qwen3VLTextRotaryEmbedding's recomposition picks it."""
    for section in ((24, 20, 20), (2, 3, 3), (6, 5, 5)):
        table = torch.zeros(3, sum(section))
        table[1], table[2] = 1, 2
        picked = table[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            picked[slice(offset, section[axis] * 3, 3)] = table[axis, slice(offset, section[axis] * 3, 3)]
        assert mrope_axes(section, interleaved=True) == picked.long().tolist()


def test_vision_tower_and_deepstack_match_transformers(vl: Fixture) -> None:
    case = vl.cases[4]
    assert case.prompt.pixel_values is not None
    with torch.no_grad():
        expected = vl.hf.model.get_image_features(case.prompt.pixel_values, case.prompt.image_grid_thw)
    images = ImageInputs.from_processor(case.prompt.pixel_values, case.prompt.image_grid_thw)
    ours = vl.model.encode_images(images)  # type: ignore[operator]
    assert len(ours) == 4 and len(expected.deepstack_features) == 2
    for k, got in enumerate(ours):
        columns = got.split(64, dim=-1)
        want = [expected.pooler_output[k]] + [feature[k] for feature in expected.deepstack_features]
        assert len(columns) == len(want)
        for c, w in zip(columns, want):
            torch.testing.assert_close(c, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_images", [n for n in IMAGE_COUNTS if n])
def test_rope_index_matches_transformers(vl: Fixture, num_images: int) -> None:
    case = vl.cases[num_images]
    inputs = hf_inputs(case.prompt)
    expected, delta = vl.hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=case.prompt.image_grid_thw
    )
    assert torch.equal(torch.tensor(case.positions.table), expected[:, 0])
    assert case.positions.delta == int(delta) < 0


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_greedy_tokens_and_logprobs_match_transformers(vl: Fixture, num_images: int) -> None:
    """Prefill the prompt (images merged at their rows, deepstack features added after
    layers 0 and 1, [3, T] positions), then decode greedily one token a step at position
    + delta: the same tokens as transformers' generate, every step's log-probabilities
    within LOGPROB_TOLERANCE of its."""
    case = vl.cases[num_images]
    rows, embeds = _image_rows(case, vl.model)
    n = len(case.prompt.token_ids)
    driver = PagedDriver(vl.model, num_seqs=1, block_size=4)
    given = {0: (rows, embeds)} if embeds is not None else None
    out = driver.step({0: case.prompt.token_ids}, rope_positions={0: case.positions.rows(0, n)}, embeds=given)[0]
    logprobs = [torch.log_softmax(out, dim=-1)]
    tokens = [int(out[-1].argmax())]
    for k in range(NUM_NEW - 1):
        step = driver.step({0: [tokens[-1]]}, rope_positions={0: case.positions.rows(n + k, n + k + 1)})[0]
        logprobs.append(torch.log_softmax(step, dim=-1))
        tokens.append(int(step[-1].argmax()))
    assert tokens == case.greedy
    got = torch.cat(logprobs)
    torch.testing.assert_close(got, case.reference[: n + NUM_NEW - 1], rtol=0, atol=LOGPROB_TOLERANCE)


def test_chunked_prefill_cuts_an_image(vl: Fixture) -> None:
    """The 4-image prompt prefilled in three chunks whose edges fall inside images (each
    chunk's image rows bring their deepstack columns along): every row as transformers'."""
    long = vl.cases[4]
    rows, embeds = _image_rows(long, vl.model)
    assert embeds is not None
    driver = PagedDriver(vl.model, num_seqs=1, block_size=4, seed=3)
    n = len(long.prompt.token_ids)
    starts = [r for i, r in enumerate(rows) if i == 0 or rows[i - 1] != r - 1]
    counts = [g[1] * g[2] // 4 for g in long.grids]
    cuts = [0, starts[0] + counts[0] // 2, starts[2] + counts[2] // 2, n]
    assert all(long.prompt.token_ids[c - 1] == long.prompt.token_ids[c] == IMAGE_PAD for c in cuts[1:-1])
    for a, b in zip(cuts[:-1], cuts[1:]):
        local = [r - a for r in rows if a <= r < b]
        first = sum(1 for r in rows if r < a)
        out = driver.step({0: long.prompt.token_ids[a:b]}, rope_positions={0: long.positions.rows(a, b)},
                          embeds={0: (local, embeds[first : first + len(local)])})  # fmt: skip
        torch.testing.assert_close(torch.log_softmax(out[0], dim=-1), long.reference[a:b], rtol=0, atol=LOGPROB_TOLERANCE)


def test_deepstack_changes_the_output(vl: Fixture) -> None:
    """The images' input embeddings without their deepstack features give other logits:
    the parity above really checks deepstack."""
    case = vl.cases[1]
    rows, embeds = _image_rows(case, vl.model)
    assert embeds is not None
    n = len(case.prompt.token_ids)
    driver = PagedDriver(vl.model, num_seqs=1, block_size=4)
    no_deepstack = torch.cat([embeds[:, :64], torch.zeros_like(embeds[:, 64:])], dim=-1)
    out = driver.step({0: case.prompt.token_ids}, rope_positions={0: case.positions.rows(0, n)},
                      embeds={0: (rows, no_deepstack)})[0]  # fmt: skip
    assert (torch.log_softmax(out, dim=-1)[-1] - case.reference[n - 1]).abs().max() > 1e-2
