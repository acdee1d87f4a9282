"""The MoE families (Qwen3-MoE, GPT-OSS) against transformers, float32, on tiny seeded
checkpoints saved by transformers (tests/hf_models.MOE_VARIANTS: sparse and dense
layer mixes, sliding and full layers, sinks, YaRN): logits of a varlen prefill,
decode steps and chunked prefill mixed with decode within 1e-4; greedy 32 tokens
through the engine (chunked prefill, continuous batching, a prefix hit) equal to
``generate``; both expert checkpoint layouts load; the per-expert token counts."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.engine.llm import LLM
from shared.model.loader import load_model
from shared.model.models.gpt_oss import GptOssForCausalLM
from shared.model.models.qwen3_moe import Qwen3MoeForCausalLM
from shared.model.moe import SparseMoE
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.hf_models import (
    MOE_VARIANTS,
    ParityCase,
    check_chunked_prefill_beside_decode,
    check_greedy_then_prefix_hit,
    check_prefill_then_decode,
    parity_case,
    random_prompts,
    save_tiny_hf_model,
)

pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT_LENS = (5, 13, 22)  # 13 and 22 are longer than every window used (6)
NUM_DECODE = 8
NUM_NEW = 32


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParityCase:
    # qwen3_moe is saved in shards, so per-expert tensors load across files.
    overrides = {"max_shard_size": "100KB"} if request.param == "qwen3_moe" else {}
    path = save_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=1, **overrides)
    return parity_case(path, PROMPT_LENS, NUM_DECODE, seed=2)


def test_model_class_follows_the_architecture(case: ParityCase) -> None:
    expected = GptOssForCausalLM if case.model.config.architecture == "GptOssForCausalLM" else Qwen3MoeForCausalLM
    assert type(case.model) is expected
    kinds = [isinstance(layer.mlp, SparseMoE) for layer in case.model.model.layers]
    assert kinds == [t != "dense" for t in case.model.config.mlp_layer_types]
    assert any(kinds)


def test_prefill_then_decode_matches_transformers(case: ParityCase) -> None:
    driver = PagedDriver(case.model, num_seqs=len(case.prompts), block_size=4)
    check_prefill_then_decode(case, driver, NUM_DECODE, TOLERANCE)


def test_chunked_prefill_mixed_with_decode(case: ParityCase) -> None:
    driver = PagedDriver(case.model, num_seqs=3, block_size=4, seed=5)
    check_chunked_prefill_beside_decode(case, driver, [(0, 7), (7, 15), (15, 22)], TOLERANCE)


def test_expert_counts_are_the_routers_choices(case: ParityCase) -> None:
    """After a forward, each sparse layer's row counts the (token, choice) pairs its
    router sent to each expert: recomputed here from the router on the same input."""
    model = case.model
    assert model.expert_counts is not None and model.config.moe is not None
    captured: list[torch.Tensor] = []
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    hooks = [b.register_forward_hook(lambda m, args, out: captured.append(args[0].clone())) for b in blocks]
    try:
        PagedDriver(model, num_seqs=1, block_size=4).step({0: case.prompts[2]})
    finally:
        for h in hooks:
            h.remove()
    k, num_experts = model.config.moe.top_k, model.config.moe.num_experts
    for row, block, x in zip(model.expert_counts, blocks, captured):
        _, ids = getattr(block, block.router_name)(x, None)
        assert torch.equal(row, torch.bincount(ids.reshape(-1), minlength=num_experts))
        assert int(row.sum()) == len(case.prompts[2]) * k


def test_engine_greedy_equals_transformers_generate(case: ParityCase) -> None:
    """Chunked prefill (chunks of 8 across blocks of 4), continuous batching (decodes
    beside chunks), then a prompt that shares a 16-token prefix with an earlier one
    (a prefix hit) alone: all equal transformers' greedy generation."""
    prompts = random_prompts([5, 17, 23, 9], vocab=500, seed=1)
    hit = prompts[1][:16] + random_prompts([6], vocab=500, seed=7)[0]
    llm = LLM(str(case.path), block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
    check_greedy_then_prefix_hit(llm, case.path, prompts, hit, num_hit_tokens=16, num_new=NUM_NEW)


def test_fused_expert_checkpoint_loads_as_per_expert(tmp_path: Path) -> None:
    """Qwen3-MoE written with transformers' in-memory layout (experts.gate_up_proj
    [E, 2I, hidden], gate then up; experts.down_proj [E, hidden, I]) loads to the same
    weights as the per-expert checkpoint transformers saves."""
    per_expert = save_tiny_hf_model("qwen3_moe", tmp_path / "per-expert", seed=3)
    tensors = load_file(str(per_expert / "model.safetensors"))
    model = load_model(per_expert)
    config = model.config
    assert config.moe is not None
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = tensor
    for i, kind in enumerate(config.mlp_layer_types):
        if kind == "dense":
            continue
        prefix = f"model.layers.{i}.mlp.experts"
        experts = range(config.moe.num_experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]]) for e in experts]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    folder = tmp_path / "fused"
    folder.mkdir()
    (folder / "config.json").write_text((per_expert / "config.json").read_text())
    save_file(fused, str(folder / "model.safetensors"))
    loaded = load_model(folder)
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
