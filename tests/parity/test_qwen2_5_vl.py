"""Our Qwen2.5-VL against transformers', float32, on a tiny seeded model (every weight
random, the tower's too) with prompts of 0, 1, 2 and 4 synthetic images of different
sizes (windows cut at the edges, partial windows, one image too small for a second
window): the tower's embeddings, the M-RoPE positions and their delta, and greedy
tokens and logprobs over a paged cache (prefill, then decode at position + delta),
also batched and with an image cut across chunked-prefill steps."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.model.interface import CausalLM
from shared.model.multimodal import ImageInputs
from shared.model.vision.mrope import MRopePositions, mrope_positions
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.vlm_models import (
    IMAGE_PAD, VLPrompt, hf_inputs, hf_vl_model, save_tiny_vl_model, synthetic_images, vl_prompt,
)  # fmt: skip

pytest.importorskip("transformers")

IMAGE_COUNTS = (0, 1, 2, 4)
# (width, height): 12x8 patches (3x2 windows), 6x10 (partial windows), 4x4 (the minimum
# area: one window), 14x10 after the resize to multiples of 28.
IMAGE_SIZES = [(112, 168), (140, 84), (60, 60), (200, 150)]
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

    path = save_tiny_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), seed=1)
    hf = hf_vl_model(path)
    images = synthetic_images(IMAGE_SIZES, seed=3)
    cases = {}
    for n in IMAGE_COUNTS:
        prompt = vl_prompt(images[:n], seed=4 + n)
        with torch.no_grad():
            out = hf.generate(**hf_inputs(prompt), max_new_tokens=NUM_NEW, do_sample=False)
            greedy = out[0, len(prompt.token_ids) :].tolist()
            logits = hf(**hf_inputs(prompt, greedy)).logits[0].float()
        grids = [] if prompt.image_grid_thw is None else [tuple(g) for g in prompt.image_grid_thw.tolist()]
        positions = mrope_positions(prompt.token_ids, grids, IMAGE_PAD, 2)
        cases[n] = Case(prompt, grids, positions, greedy, torch.log_softmax(logits, dim=-1))
    return Fixture(path, hf, load_model(path), cases)


def _image_rows(case: Case, model: CausalLM) -> tuple[list[int], torch.Tensor | None]:
    """The prompt's image-pad rows and the tower's embeddings for them."""
    rows = [i for i, t in enumerate(case.prompt.token_ids) if t == IMAGE_PAD]
    if not rows:
        return rows, None
    assert case.prompt.pixel_values is not None and case.prompt.image_grid_thw is not None
    images = ImageInputs.from_processor(case.prompt.pixel_values, case.prompt.image_grid_thw)
    return rows, torch.cat(model.encode_images(images))  # type: ignore[operator]


def test_vision_tower_matches_transformers(vl: Fixture) -> None:
    case = vl.cases[4]
    assert case.prompt.pixel_values is not None
    with torch.no_grad():
        expected = vl.hf.model.get_image_features(case.prompt.pixel_values, case.prompt.image_grid_thw).pooler_output
    images = ImageInputs.from_processor(case.prompt.pixel_values, case.prompt.image_grid_thw)
    ours = vl.model.encode_images(images)  # type: ignore[operator]
    assert [t.shape for t in ours] == [t.shape for t in expected]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_images", [n for n in IMAGE_COUNTS if n])
def test_rope_index_matches_transformers(vl: Fixture, num_images: int) -> None:
    """The table and the delta are exactly get_rope_index's; the images really moved the
    positions (delta < 0: each image takes fewer positions than tokens)."""
    case = vl.cases[num_images]
    inputs = hf_inputs(case.prompt)
    expected, delta = vl.hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=case.prompt.image_grid_thw
    )
    assert torch.equal(torch.tensor(case.positions.table), expected[:, 0])
    assert case.positions.delta == int(delta) < 0


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_greedy_tokens_and_logprobs_match_transformers(vl: Fixture, num_images: int) -> None:
    """Prefill the prompt (images merged at their rows, [3, T] positions), then decode
    greedily one token a step at position + delta: the same tokens as transformers'
    generate, every step's log-probabilities within LOGPROB_TOLERANCE of its."""
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


def test_batched_chunked_prefill_cuts_an_image(vl: Fixture) -> None:
    """The 4-image prompt prefilled in three chunks whose edges fall inside images,
    beside the other prompts (prefilled in the first step, then decoding their greedy
    tokens): every row's log-probabilities as transformers'."""
    long = vl.cases[4]
    rows, embeds = _image_rows(long, vl.model)
    assert embeds is not None
    others = [vl.cases[n] for n in (0, 1, 2)]
    driver = PagedDriver(vl.model, num_seqs=4, block_size=4, seed=3)
    n = len(long.prompt.token_ids)
    # Cut in the middle of the first and of the third image.
    starts = [r for i, r in enumerate(rows) if i == 0 or rows[i - 1] != r - 1]
    counts = [g[1] * g[2] // 4 for g in long.grids]
    cuts = [0, starts[0] + counts[0] // 2, starts[2] + counts[2] // 2, n]
    assert all(long.prompt.token_ids[c - 1] == long.prompt.token_ids[c] == IMAGE_PAD for c in cuts[1:-1])
    for step in range(len(cuts) - 1):
        a, b = cuts[step], cuts[step + 1]
        new = {3: long.prompt.token_ids[a:b]}
        positions = {3: long.positions.rows(a, b)}
        local = [r - a for r in rows if a <= r < b]
        first = sum(1 for r in rows if r < a)
        given = {3: (local, embeds[first : first + len(local)])}
        for s, case in enumerate(others):
            m = len(case.prompt.token_ids)
            if step == 0:
                new[s] = case.prompt.token_ids
                positions[s] = case.positions.rows(0, m)
                r, e = _image_rows(case, vl.model)
                if e is not None:
                    given[s] = (r, e)
            else:
                pos = m + step - 1
                new[s] = [case.greedy[step - 1]]
                positions[s] = case.positions.rows(pos, pos + 1)
        out = driver.step(new, rope_positions=positions, embeds=given)
        torch.testing.assert_close(
            torch.log_softmax(out[3], dim=-1), long.reference[a:b], rtol=0, atol=LOGPROB_TOLERANCE
        )
        for s, case in enumerate(others):
            m = len(case.prompt.token_ids)
            lo, hi = (0, m) if step == 0 else (m + step - 1, m + step)
            torch.testing.assert_close(
                torch.log_softmax(out[s], dim=-1), case.reference[lo:hi], rtol=0, atol=LOGPROB_TOLERANCE
            )


def test_images_change_the_output(vl: Fixture) -> None:
    """The same tokens with the image embeddings left as the image-pad embedding (a model
    that dropped its images) give other logits: the parity above really checks images."""
    case = vl.cases[1]
    n = len(case.prompt.token_ids)
    driver = PagedDriver(vl.model, num_seqs=1, block_size=4)
    out = driver.step({0: case.prompt.token_ids}, rope_positions={0: case.positions.rows(0, n)})[0]
    assert (torch.log_softmax(out, dim=-1)[-1] - case.reference[n - 1]).abs().max() > 1e-2
