"""Decode after a handoff runs the vision tower only for the images whose rows it
computes (shared/engine/images.py, PromptEmbeds): a prefill engine computes a
vision-language prompt and stores its full blocks; a decode engine resumes the request
loading them, as services/decode does. An image wholly in the loaded blocks is never
encoded on decode; one that reaches into the partial last block (which decode
recomputes) is, alone; when the load brings nothing (kvcache lost the blocks) decode
encodes the images as its steps reach them. Every case gives the tokens and logprobs
of one engine that ran the request whole."""

from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine_request import RequestImages
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import TokenLogprobs
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.transfer import KVTransferParams
from shared.model.multimodal import ImageInputs
from tests.helpers.engine_helpers import generate, run
from tests.helpers.vlm_models import IMAGE_PAD, VLPrompt, save_tiny_vl_model, synthetic_images, vl_prompt

pytest.importorskip("transformers")

BLOCK = 8
NUM_NEW = 5
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SAVE = KVTransferParams(load=True, save=True)
"""Prefill's request: its full blocks stored before its output (the kvcache handoff)."""
# 60x60: 4x4 patches, 4 image tokens; 112x168: 8x12 patches, 24.
SMALL, LARGE = (60, 60), (112, 168)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vl_model(tmp_path_factory.mktemp("vl_handoff"), seed=1)


def _engine(model_dir: Path, store: MemoryKVStore | None) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), block_size=BLOCK)
    return LLMEngine(config, kv_connector=None if store is None else MemoryConnector(store))


def _images(prompt: VLPrompt) -> RequestImages:
    assert prompt.pixel_values is not None
    inputs = ImageInputs.from_processor(prompt.pixel_values, prompt.image_grid_thw)
    return RequestImages(inputs, tuple(bytes([k + 1]) * 32 for k in range(len(inputs.grids))))


Generated = tuple[RequestOutput, list[TokenLogprobs]]


def _handoff(model_dir: Path, prompt: VLPrompt, lose_blocks: bool = False) -> tuple[LLMEngine, Generated]:
    """Prefill computes the prompt and its first token, storing its full blocks; decode
    resumes it (from an empty store where lose_blocks). The decode engine and its output."""
    store = MemoryKVStore()
    prefill = _engine(model_dir, store)
    first = run(prefill, "r", prompt.token_ids, FIRST, kv_transfer=SAVE, images=_images(prompt))
    assert prefill.num_images_encoded == len(prompt.image_grid_thw)
    assert len(store.blocks) == len(prompt.token_ids) // BLOCK
    decode = _engine(model_dir, MemoryKVStore() if lose_blocks else store)
    out = generate(decode, "r", prompt.token_ids, PARAMS, resume_token_ids=first.token_ids,
                   kv_transfer=KVTransferParams(load=True), images=_images(prompt))  # fmt: skip
    prefill.close()
    decode.close()
    return decode, out


def _whole(model_dir: Path, prompt: VLPrompt) -> Generated:
    engine = _engine(model_dir, None)
    out = generate(engine, "r", prompt.token_ids, PARAMS, images=_images(prompt))
    engine.close()
    return out


def _check(out: Generated, whole: Generated) -> None:
    (final, logprobs), (whole_final, whole_logprobs) = out, whole
    assert final.token_ids == whole_final.token_ids
    # Decode's first token is prefill's: compare the logprobs of those decode sampled.
    got = torch.tensor([lp.logprob for lp in logprobs])
    want = torch.tensor([lp.logprob for lp in whole_logprobs[-len(logprobs) :]])
    assert len(logprobs) == NUM_NEW - 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _tail_start(prompt: VLPrompt) -> int:
    """The first prompt position decode computes: after the full blocks it loads."""
    return len(prompt.token_ids) // BLOCK * BLOCK


def _last_image_token(prompt: VLPrompt) -> int:
    return max(i for i, t in enumerate(prompt.token_ids) if t == IMAGE_PAD)


def _prompt(sizes: list[tuple[int, int]], text_lens: list[int], seed: int) -> VLPrompt:
    return vl_prompt(synthetic_images(sizes, seed=seed), seed=seed, text_lens=text_lens)


def test_decode_runs_no_tower_for_an_image_in_the_blocks_it_loads(model_dir: Path) -> None:
    prompt = _prompt([LARGE], [5, 20], seed=21)
    assert _last_image_token(prompt) < _tail_start(prompt)  # the image lies in the loaded blocks
    decode, out = _handoff(model_dir, prompt)
    assert out[0].kv is not None and out[0].kv.num_loaded_blocks == len(prompt.token_ids) // BLOCK
    assert decode.num_images_encoded == 0
    _check(out, _whole(model_dir, prompt))


def test_decode_encodes_only_the_image_that_reaches_into_the_block_it_recomputes(model_dir: Path) -> None:
    # 5 text, a 4-token image (in its start and end tokens), 5 text, a 24-token image, 1
    # text: 43 tokens, full blocks to 40, the second image's last token at 40.
    prompt = _prompt([SMALL, LARGE], [5, 5, 1], seed=22)
    assert _tail_start(prompt) == 40 and _last_image_token(prompt) >= 40  # the second image reaches past it
    decode, out = _handoff(model_dir, prompt)
    assert decode.num_images_encoded == 1
    _check(out, _whole(model_dir, prompt))


def test_decode_encodes_the_images_when_the_blocks_do_not_arrive(model_dir: Path) -> None:
    prompt = _prompt([SMALL, LARGE], [5, 6, 20], seed=23)
    assert _last_image_token(prompt) < _tail_start(prompt)
    decode, out = _handoff(model_dir, prompt, lose_blocks=True)
    assert out[0].kv is not None and out[0].kv.num_loaded_blocks == 0
    assert decode.num_images_encoded == 2  # at the step that recomputed them, not at admission
    _check(out, _whole(model_dir, prompt))
