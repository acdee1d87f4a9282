"""Our paged-KV CausalLM against transformers, float32, on tiny random models of every
supported architecture: one varlen prefill of prompts of different lengths, then
batched single-token decode steps, then chunked prefill mixed with decode."""

from pathlib import Path

import pytest
import torch

from shared.model.arch_config import RopeConfig
from shared.model.config import ModelConfig
from shared.model.layers import rope_inv_freq
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.numerics import rel_err
from tests.helpers.hf_models import (
    ARCH_VARIANTS,
    ParityCase,
    check_chunked_prefill_beside_decode,
    check_prefill_then_decode,
    hf_logits,
    parity_case,
    save_tiny_hf_model,
)

pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT_LENS = (5, 13, 22)  # 22 > every sliding window used, and spans 6 blocks of 4
NUM_DECODE = 8
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=list(ARCH_VARIANTS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParityCase:
    arch = request.param
    # Qwen2 is saved in small shards so the loader's index path runs on a real HF layout.
    overrides = {"max_shard_size": "40KB"} if arch == "qwen2" else {}
    path = save_tiny_hf_model(arch, tmp_path_factory.mktemp(arch), seed=1, **overrides)
    if arch == "qwen2":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    return parity_case(path, PROMPT_LENS, NUM_DECODE, seed=2)


def test_prefill_then_decode_matches_transformers(case: ParityCase) -> None:
    driver = PagedDriver(case.model, num_seqs=len(case.prompts), block_size=BLOCK_SIZE)
    check_prefill_then_decode(case, driver, NUM_DECODE, TOLERANCE)


def test_chunked_prefill_mixed_with_decode(case: ParityCase) -> None:
    """Sequence 2 is prefilled in chunks of 7, 8, 7 tokens; sequence 0 is prefilled in the
    first step and decodes one token alongside each later chunk."""
    driver = PagedDriver(case.model, num_seqs=3, block_size=BLOCK_SIZE, seed=5)
    check_chunked_prefill_beside_decode(case, driver, [(0, 7), (7, 15), (15, 22)], TOLERANCE)


def test_sliding_window_bites(tmp_path: Path) -> None:
    """The mistral prompts are longer than its window, so dropping the window changes logits:
    the parity above really checks the window."""
    ids = [list(range(3, 3 + max(PROMPT_LENS)))]
    windowed = hf_logits(save_tiny_hf_model("mistral", tmp_path / "w", seed=1), ids)[0]
    full = hf_logits(save_tiny_hf_model("mistral", tmp_path / "f", seed=1, sliding_window=None), ids)[0]
    window = ARCH_VARIANTS["mistral"][1]["sliding_window"]
    assert torch.equal(windowed[:window], full[:window])
    assert rel_err(windowed[window:], full[window:]) > 1e-3


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="default", rope_theta=10000.0),
        dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_inv_freq_is_bitwise_transformers(rope: dict[str, object], head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=dict(rope)
    )
    init = ROPE_INIT_FUNCTIONS.get(str(rope["rope_type"]), LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, attention_scaling = init(hf_config)
    assert attention_scaling == 1.0
    ours = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope
    assert isinstance(ours, RopeConfig)
    assert torch.equal(rope_inv_freq(ours, head_dim), expected)
