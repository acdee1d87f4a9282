"""vLLM's `--tensor-parallel-size N --enable-expert-parallel` (issue 28): each rank of an
expert-parallel Qwen3-MoE or GPT-OSS instance holds 1/N of the attention (its query
heads, its KV heads, GPT-OSS's sinks of its heads), of the dense MLPs and of the
vocabulary, and 1/N of each MoE layer's experts; its KV cache holds its KV heads only.
DeepSeek-V4 splits its query heads beside its expert-parallel MoE layers, its KV whole on
every rank (tests/parity/test_deepseek_v4_tensor_parallel.py). The ranks are real gloo processes built as the executor builds them
(tests/helpers/parallel_rank_models.py); that the split model gives one process's
tokens is tests/parity/test_expert_parallel_engine.py's."""

from pathlib import Path

import pytest
from safetensors import safe_open

from shared.engine.config import EngineConfig
from shared.engine.executor.rank import splits_attention
from shared.engine.llm import LLM
from shared.model.loader import read_config
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.parallel_rank_models import rank_model_reports

pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 512  # the tiny models' (tests/helpers/hf_models.py)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_each_rank_holds_its_heads_its_columns_its_vocabulary_and_its_experts(family: str, tmp_path: Path) -> None:
    path = save_tiny_hf_model(family, tmp_path / family, seed=1)
    head_dim = read_config(path).head_dim
    config = EngineConfig(model=str(path), tensor_parallel_size=2, enable_expert_parallel=True)
    reports = rank_model_reports(config)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        sinks = f.get_tensor("model.layers.0.self_attn.sinks").tolist() if family == "gpt_oss" else None
    for rank, got in enumerate(reports):
        for layer in range(3):
            attn = f"model.layers.{layer}.self_attn"
            # 2 of 4 query heads and 1 of 2 KV heads (k and v) a rank; o_proj over its heads' columns.
            assert got[f"{attn}.qkv_proj.weight"] == ((HEADS // 2 + 2 * KV_HEADS // 2) * head_dim, HIDDEN)
            assert got[f"{attn}.o_proj.weight"] == (HIDDEN, HEADS // 2 * head_dim)
        assert got["kv_row_shape"] == (KV_HEADS // 2, head_dim)  # the rank's cache rows: its KV head
        assert got["model.embed_tokens.weight"] == (VOCAB // 2, HIDDEN)
        assert got["lm_head.weight"] == (VOCAB // 2, HIDDEN)
        experts = {n: s for n, s in got.items() if ".experts." in n}
        assert experts and all(shape[0] == 4 for shape in experts.values())  # 4 of 8 experts a layer
        if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers): gate and up split by columns
            assert got["model.layers.1.mlp.gate_up_proj.weight"] == (2 * 128 // 2, HIDDEN)
            assert got["model.layers.1.mlp.down_proj.weight"] == (HIDDEN, 128 // 2)
        else:  # the sinks of the rank's heads, as loaded
            assert sinks is not None and got["sinks"] == pytest.approx(sinks[2 * rank : 2 * rank + 2], abs=0)


def test_the_engine_s_rank_zero_runs_tensor_parallel_attention_and_its_cache_holds_its_heads(tmp_path: Path) -> None:
    path = save_tiny_hf_model("qwen3_moe", tmp_path / "qwen3_moe", seed=1)
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, block_size=4)
    try:
        engine = llm.engine
        assert engine.model.parallel.tp_size == 2 and engine.model.parallel.ep_size == 2  # type: ignore[attr-defined]
        assert engine.runner.kv_caches[0].shape[-2:] == (KV_HEADS // 2, read_config(path).head_dim)
    finally:
        llm.engine.close()


def test_deepseek_v4_splits_its_attention_beside_experts_and_data_parallel_attention_is_not_split(tmp_path: Path) -> None:
    """V4 splits its query heads beside EP (tests/parity/test_deepseek_v4_tensor_parallel.py);
    data-parallel attention never splits."""
    v4 = save_tiny_v4("mixed", tmp_path / "v4", seed=1)
    moe = save_tiny_hf_model("qwen3_moe", tmp_path / "qwen3_moe", seed=1)
    ep = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    assert splits_attention(EngineConfig(model=str(v4), **ep), read_config(v4))
    v4_dp = EngineConfig(model=str(v4), data_parallel_size=2, enable_expert_parallel=True)
    assert not splits_attention(v4_dp, read_config(v4))
    assert splits_attention(EngineConfig(model=str(moe), **ep), read_config(moe))
    dp = EngineConfig(model=str(moe), data_parallel_size=2, enable_expert_parallel=True)
    assert not splits_attention(dp, read_config(moe))
    assert splits_attention(EngineConfig(model=str(moe), tensor_parallel_size=2), read_config(moe))
