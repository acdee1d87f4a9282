"""Qwen2.5-VL through the whole engine (LLM.generate: scheduler, paged cache, prefix
cache, runner) against transformers' generate on a tiny seeded model: greedy tokens
and every step's logprob for prompts of 0, 1 and 2 images batched with text-only
ones, chunked prefill whose chunks cut images, a preempted image request, the prefix
cache (the same image hits, another image of the same size misses), and the
refusals by name."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.engine.engine_request import EngineRequest, RequestImages
from shared.engine.llm import LLM, CompletionOutput
from shared.engine.sampling_params import InvalidParam, SamplingParams
from shared.model.multimodal import ImageInputs
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.vlm_models import (
    IMAGE_PAD, VIDEO_PAD, VLPrompt, hf_inputs, hf_vl_model, save_tiny_vl_model, synthetic_images, vl_prompt,
)  # fmt: skip

pytest.importorskip("transformers")

NUM_NEW = 8
LOGPROB_TOLERANCE = 1e-4
# 112x168: 8x12 patches, 24 image tokens; 140x84: 10x6 (one more resize step), 15; 60x60: 4x4, 4.
IMAGE_SIZES = [(112, 168), (140, 84), (60, 60)]
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
    hf: Any
    images: list[Any]

    def reference(self, prompt: VLPrompt) -> Case:
        with torch.no_grad():
            out = self.hf.generate(**hf_inputs(prompt), max_new_tokens=NUM_NEW, do_sample=False)
            greedy = out[0, len(prompt.token_ids) :].tolist()
            logits = self.hf(**hf_inputs(prompt, greedy)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        n = len(prompt.token_ids)
        return Case(prompt, greedy, [float(logprobs[n - 1 + i, t]) for i, t in enumerate(greedy)])


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    path = save_tiny_vl_model(tmp_path_factory.mktemp("qwen2_5_vl_engine"), seed=1)
    return Fixture(path, hf_vl_model(path), synthetic_images(IMAGE_SIZES + [(112, 168)], seed=3))


@pytest.fixture(scope="module")
def cases(vl: Fixture) -> dict[str, Case]:
    return {
        "text": vl.reference(vl_prompt([], seed=10, text_lens=[23])),
        "one": vl.reference(vl_prompt(vl.images[:1], seed=11)),
        "two": vl.reference(vl_prompt(vl.images[1:3], seed=12, text_lens=[9, 6, 11])),
        "text2": vl.reference(vl_prompt([], seed=13, text_lens=[7])),
    }


def _check(out: CompletionOutput, case: Case) -> None:
    assert out.token_ids == case.greedy
    got = [lp.logprob for lp in out.logprobs]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(case.chosen), rtol=0, atol=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_images_batched_with_text_equal_transformers(vl: Fixture, cases: dict[str, Case], overlap: bool) -> None:
    """0, 1 and 2 images and text-only prompts in one continuous batch, chunks small
    enough that decode steps mix with prefill chunks; also with overlapped steps (the
    GPU's default: a step is launched before the last one's tokens are read back)."""
    llm = LLM(str(vl.path), block_size=4, prefill_chunk_size=8, max_num_batched_tokens=64, async_scheduling=overlap)
    order = ["text", "one", "two", "text2"]
    outs = llm.generate([cases[k].prompt.token_ids for k in order], PARAMS, images=[cases[k].images for k in order])
    for out, key in zip(outs, order):
        _check(out, cases[key])
    assert not llm.engine.runner.image_embeds and not llm.engine.runner.prompt_images  # dropped at the finish


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_cutting_images_equals_transformers(vl: Fixture, cases: dict[str, Case], chunk: int) -> None:
    """A prompt alone in steps of `chunk` tokens: steps begin and end inside its images
    (a chunk of image rows only, of text and image, of text between two images)."""
    case = cases["two"]
    llm = LLM(str(vl.path), block_size=4, max_num_batched_tokens=chunk, prefill_chunk_size=chunk)
    _check(llm.generate([case.prompt.token_ids], PARAMS, images=[case.images])[0], case)


def test_preempted_image_request_recomputes_its_images(vl: Fixture, cases: dict[str, Case]) -> None:
    """A cache too small for all at once: the youngest is preempted and recomputes its
    prompt, image rows included, from the embeddings the runner kept."""
    order = ["one", "two", "text"]
    llm = LLM(str(vl.path), block_size=4, num_kv_blocks=20, max_model_len=64, prefill_chunk_size=8,
              max_num_batched_tokens=32, enable_prefix_caching=False)  # fmt: skip
    outs = llm.generate([cases[k].prompt.token_ids for k in order], PARAMS, images=[cases[k].images for k in order])
    assert llm.engine.scheduler.num_preemptions > 0
    for out, key in zip(outs, order):
        _check(out, cases[key])


def test_prefix_cache_hits_the_same_image_and_misses_another(vl: Fixture, cases: dict[str, Case]) -> None:
    """Images 0 and 3 have the same size, so their prompts' token ids are equal: only the
    images' names in the block hashes keep their KV apart. The same image again is a hit
    past the image; the other image hits only the blocks before it, and its output is
    transformers' for that image (no KV of the first image served)."""
    first = cases["one"]
    other = vl.reference(vl_prompt([vl.images[3]], seed=11))
    assert other.prompt.token_ids == first.prompt.token_ids
    assert not torch.equal(other.prompt.pixel_values, first.prompt.pixel_values)
    bs = 4
    llm = LLM(str(vl.path), block_size=bs)
    _check(llm.generate([first.prompt.token_ids], PARAMS, images=[first.images])[0], first)
    again = llm.generate([first.prompt.token_ids], PARAMS, images=[first.images])[0]
    _check(again, first)
    n = len(first.prompt.token_ids)
    assert again.num_cached_tokens == (n - 1) // bs * bs
    miss = llm.generate([other.prompt.token_ids], PARAMS, images=[other.images])[0]
    _check(miss, other)
    image_start = first.prompt.token_ids.index(IMAGE_PAD)
    assert miss.num_cached_tokens == image_start // bs * bs


def test_images_given_with_names_share_kv_by_name(vl: Fixture, cases: dict[str, Case]) -> None:
    """RequestImages: the caller's names, not the pixels, key the blocks (the API's identity)."""
    case = cases["one"]
    assert case.images is not None
    llm = LLM(str(vl.path), block_size=4)
    named = RequestImages(case.images, (b"\x01" * 32,))
    llm.generate([case.prompt.token_ids], PARAMS, images=[named])
    unnamed = llm.generate([case.prompt.token_ids], PARAMS, images=[case.images])[0]
    again = llm.generate([case.prompt.token_ids], PARAMS, images=[named])[0]
    image_start = case.prompt.token_ids.index(IMAGE_PAD)
    assert unnamed.num_cached_tokens == image_start // 4 * 4
    assert again.num_cached_tokens > image_start


def _refused(llm: LLM, prompt: list[int], images: Any, param: str, words: str) -> None:
    with pytest.raises(InvalidParam) as info:
        llm.generate([prompt], PARAMS, images=[images])
    assert info.value.param == param and words in info.value.message
    assert not llm.engine.has_unfinished_requests()


def test_refusals_name_the_param(vl: Fixture, cases: dict[str, Case], tmp_path: Path) -> None:
    llm = LLM(str(vl.path), block_size=4)
    one, two = cases["one"], cases["two"]
    # One image's placeholders, two images (and the reverse).
    _refused(llm, one.prompt.token_ids, two.images, "images", "do not match")
    _refused(llm, two.prompt.token_ids, one.images, "images", "do not match")
    # A run one token short of the image's count.
    short = list(one.prompt.token_ids)
    short.remove(IMAGE_PAD)
    _refused(llm, short, one.images, "images", "do not match")
    _refused(llm, one.prompt.token_ids, None, "prompt", "no images")
    _refused(llm, cases["text"].prompt.token_ids[:5] + [VIDEO_PAD, 7], None, "prompt", "video")
    ngram = LLM(str(vl.path), block_size=4, speculative="ngram")
    _refused(ngram, one.prompt.token_ids, one.images, "images", "speculative")
    text_model = tmp_path / "llama"
    save_tiny_hf_model("llama", text_model)
    _refused(LLM(str(text_model), block_size=4), [5, 6, 7], one.images, "images", "text-only")


def test_abort_drops_the_images(vl: Fixture, cases: dict[str, Case]) -> None:
    case = cases["one"]
    llm = LLM(str(vl.path), block_size=4)
    engine = llm.engine
    images = RequestImages(case.images, (b"\x02" * 32,))  # type: ignore[arg-type]
    engine.add_request(EngineRequest("a", case.prompt.token_ids, PARAMS, images=images))
    engine.add_request(EngineRequest("b", case.prompt.token_ids, PARAMS, images=images))
    engine.step()  # "a" and "b" scheduled: the runner holds both
    engine.abort_request("a")
    engine.add_request(EngineRequest("c", case.prompt.token_ids, PARAMS, images=images))
    engine.abort_request("c")  # never scheduled
    assert set(engine.runner.image_embeds) == {"b"}
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.runner.image_embeds and not engine.runner.prompt_images


class RowGraphs:
    """A CPU stand-in for DecodeGraphs: runs the rows the runner hands a graph replay
    (graph_rows: one row per token, positions as given) through the model eagerly, so
    the graphed path's inputs, the rope delta among them, are checked without a GPU."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.num_replays = 0

    def can_run(self, num_tokens: int, max_blocks: int) -> bool:
        return True

    def run(self, input_ids: list[int], positions: list[int], slots: list[list[int]], seq_lens: list[int],
            tables: list[list[list[int]]], placeholder_sources: list[int] | None = None,
            last_tokens: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        from shared.engine.step_inputs import fill_placeholders
        from shared.model.forward_batch import AttentionMetadata

        self.num_replays += 1
        ids = torch.tensor(input_ids)
        if placeholder_sources is not None and last_tokens is not None:
            ids = fill_placeholders(ids, torch.tensor(placeholder_sources), last_tokens)
        n = len(input_ids)
        metas = []
        for group_slots, group_tables in zip(slots, tables):
            width = max(len(t) for t in group_tables)
            padded = [t + [0] * (width - len(t)) for t in group_tables]
            metas.append(AttentionMetadata(torch.tensor(group_slots), torch.tensor(padded), list(range(n + 1)),
                                           list(seq_lens), self.runner.block_size))  # fmt: skip
        return self.runner.model(ids, torch.tensor(positions), self.runner.kv_caches, metas)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_decode_through_the_graph_rows_equals_transformers(vl: Fixture, cases: dict[str, Case], overlap: bool) -> None:
    """Decode steps take the graph path (prefill chunks holding image tokens never do):
    its 1-row positions shifted by each request's rope delta give transformers' tokens."""
    llm = LLM(str(vl.path), block_size=4, async_scheduling=overlap)
    graphs = RowGraphs(llm.engine.runner)
    llm.engine.runner.graphs = graphs  # type: ignore[assignment]
    order = ["one", "two", "text"]
    outs = llm.generate([cases[k].prompt.token_ids for k in order], PARAMS, images=[cases[k].images for k in order])
    assert graphs.num_replays >= NUM_NEW - 1
    for out, key in zip(outs, order):
        _check(out, cases[key])
