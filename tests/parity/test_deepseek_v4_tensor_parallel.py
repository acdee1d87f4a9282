"""DeepSeek-V4 tensor-parallel (issue 28), alone and beside expert parallelism, over real
gloo processes on the CPU, against one process.

Each rank holds its query heads (q_b_proj's rows, the sinks of its heads), its groups of
the grouped output projection (o_a_proj's blocks, o_b_proj's columns, summed by an
all-reduce), its columns of the shared experts (tensor parallelism alone; beside expert
parallelism the MoE block is whole, then split by expert and by token), its slice of the
vocabulary; the KV path (q_a_proj, kv_proj, compressor, indexer), every cache and mHC
are whole on every rank.

The logits are within float32 rounding of one process's, not bitwise: o_b_proj's, the
shared experts' and the embedding's all-reduces sum partial products in another order
than one matmul, and the MoE's token split runs matmuls over other row counts. Measured
on a 321-token prompt (80 CSA and 20 HCA entries, the indexer picking 6 of them) and
decode steps: max |TP - single| 1.3e-6 with TP=2 and 1.4e-6 with TP=2 and EP=2, of
logits up to ~1.7 (relative 8e-7); BOUND is 1e-5 of max|logit|, as
tests/parity/test_tensor_parallel.py's. Every rank holds bitwise the same logits (an
all-gather is a copy).
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from shared.engine.config import EngineConfig
from shared.engine.executor.rank import check_split, splits_attention
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import read_config
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import random_prompts
from tests.helpers.parallel_rank_models import rank_model_reports
from tests.helpers.tensor_parallel import Steps, paged_logits, tensor_parallel_logits

pytest.importorskip("transformers")

BOUND = 1e-5
"""max|TP - single| / max|single| (the module docstring says why)."""
LOGPROB_TOLERANCE = 1e-4
"""|TP - single| of a sampled token's logprob (measured: 4.8e-7)."""
BLOCK = 16  # a multiple of both compression rates (4 and 16)
DRIVER = {"block_size": BLOCK, "num_blocks": 256}
HIDDEN, HEADS, HEAD_DIM, Q_LORA, O_GROUPS, O_LORA, VOCAB, MOE_INTER = 64, 4, 32, 24, 2, 16, 512, 32  # the tiny V4's
MODES = {"tp": {}, "tp+ep": {"enable_expert_parallel": True}}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of layer (sliding, CSA with its indexer, HCA), a hash-routed first layer."""
    return save_tiny_v4("mixed", tmp_path_factory.mktemp("v4-tp"), seed=1)


def _steps() -> Steps:
    """A varlen prefill of a 321-token prompt (past the window of 16, 80 CSA and 20 HCA
    entries) and a 37-token one, then four batched decode steps."""
    prompts = random_prompts([321, 37], vocab=500, seed=3)
    decode = random_prompts([2] * 4, vocab=500, seed=4)
    return [dict(enumerate(prompts))] + [{s: [token] for s, token in enumerate(step)} for step in decode]


@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_give_the_logits_of_one(mixed: Path, mode: str) -> None:
    steps = _steps()
    reference = paged_logits(mixed, steps, driver=DRIVER)
    (ranks,) = tensor_parallel_logits([(mixed, steps)], 2, driver=DRIVER, expert_parallel=mode == "tp+ep")
    worst = 0.0
    for ref_step, *rank_steps in zip(reference, *ranks):
        for seq, ref in ref_step.items():
            assert torch.equal(rank_steps[0][seq], rank_steps[1][seq])  # every rank: the same numbers
            diff = (rank_steps[0][seq] - ref).abs().max().item()
            worst = max(worst, diff)
            assert diff / ref.abs().max().item() < BOUND, f"{mode}: |TP - single| {diff:.2e}"
    print(f"{mode}: max |TP - single| logit {worst:.3g}")


@pytest.mark.parametrize("mode", list(MODES))
def test_each_rank_holds_its_heads_its_groups_its_vocabulary_and_the_whole_kv_path(mixed: Path, mode: str) -> None:
    reports = rank_model_reports(EngineConfig(model=str(mixed), tensor_parallel_size=2, **MODES[mode]))
    with safe_open(str(mixed / "model.safetensors"), "pt") as f:
        sinks = f.get_tensor("model.layers.0.attn.attn_sink").tolist()
    heads_dim = HEADS * HEAD_DIM
    for rank, got in enumerate(reports):
        for layer in range(4):
            attn = f"model.layers.{layer}.self_attn"
            assert got[f"{attn}.q_b_proj.weight"] == (heads_dim // 2, Q_LORA)  # 2 of 4 heads
            assert got[f"{attn}.o_a_proj.weight"] == (O_GROUPS // 2 * O_LORA, heads_dim // O_GROUPS)  # 1 of 2 groups
            assert got[f"{attn}.o_b_proj.weight"] == (HIDDEN, O_GROUPS // 2 * O_LORA)
            assert got[f"{attn}.sinks"] == (HEADS // 2,)
            # The one KV head and the query LoRA's first half: whole on every rank.
            assert got[f"{attn}.kv_proj.weight"] == (HEAD_DIM, HIDDEN)
            assert got[f"{attn}.q_a_proj.weight"] == (Q_LORA, HIDDEN)
        assert got["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"] == (16 * 16, Q_LORA)
        assert got["model.embed_tokens.weight"] == (VOCAB // 2, HIDDEN)
        assert got["lm_head.weight"] == (VOCAB // 2, HIDDEN)
        assert sinks[2 * rank : 2 * rank + 2] == pytest.approx(got["sinks"], abs=0)
        experts = {n: s for n, s in got.items() if ".experts." in n and ".shared_experts." not in n}
        shared = {n.rpartition("shared_experts.")[2]: s for n, s in got.items() if "layers.0." in n and "shared_experts" in n}
        if mode == "tp":  # routed experts whole on every rank, shared experts split by columns
            assert experts and all(shape[0] == 8 for shape in experts.values())
            assert shared == {"gate_up_proj.weight": (2 * MOE_INTER // 2, HIDDEN), "down_proj.weight": (HIDDEN, MOE_INTER // 2)}
        else:  # 4 of 8 experts a rank; the block (shared experts too) whole, split by token
            assert experts and all(shape[0] == 4 for shape in experts.values())
            assert shared == {"gate_up_proj.weight": (2 * MOE_INTER, HIDDEN), "down_proj.weight": (HIDDEN, MOE_INTER)}


def test_the_split_is_refused_by_name_where_heads_or_groups_do_not_divide(tmp_path: Path) -> None:
    one_group = save_tiny_v4("csa_only", tmp_path / "one-group", seed=1, o_groups=1)
    for path, tp, ep, reason in [
        (one_group, 2, False, "o_groups (1) is not divisible by tensor_parallel_size (2)"),
        (one_group, 2, True, "o_groups (1) is not divisible by tensor_parallel_size (2)"),
        (one_group, 3, False, "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
    ]:
        with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            check_split(EngineConfig(model=str(path), tensor_parallel_size=tp, enable_expert_parallel=ep), read_config(path))
    fine = save_tiny_v4("csa_only", tmp_path / "two-groups", seed=1)
    check_split(EngineConfig(model=str(fine), tensor_parallel_size=2), read_config(fine))
    assert splits_attention(EngineConfig(model=str(fine), tensor_parallel_size=2, enable_expert_parallel=True),
                            read_config(fine))  # fmt: skip


def _generate(model: str, **settings: Any) -> tuple[list[list[int]], list[list[float]], list[tuple[int, ...]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(model, block_size=BLOCK, prefill_chunk_size=64, max_num_batched_tokens=96, **settings)
    try:
        outputs = llm.generate(random_prompts([321, 40], vocab=500, seed=5), params)
        caches = [tuple(c.shape) for c in llm.engine.runner.kv_caches]
    finally:
        llm.engine.close()
    return [o.token_ids for o in outputs], [[s.logprob for s in o.logprobs] for o in outputs], caches


@pytest.mark.parametrize("mode", list(MODES))
def test_the_engine_over_two_ranks_generates_the_tokens_of_one_process(mixed: Path, mode: str) -> None:
    """Chunked prefill of a 321-token prompt beside a short one, then greedy decoding;
    each rank's caches are one process's (the whole KV, no head split)."""
    tokens, logprobs, caches = _generate(str(mixed))
    tp_tokens, tp_logprobs, tp_caches = _generate(str(mixed), tensor_parallel_size=2, **MODES[mode])
    assert tp_tokens == tokens
    assert tp_caches == caches
    worst = max(abs(a - b) for one, tp in zip(logprobs, tp_logprobs) for a, b in zip(one, tp))
    print(f"{mode}: worst |TP - single| logprob {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE
