"""Tokens per expert per sparse layer through the engine: every step's counts ride back
with its tokens (RunnerOutput.expert_counts, copied without a sync of their own) and sum
into EngineLoad.tokens_per_expert, which must equal what the routers chose over the
run, counted here from the routers' own outputs (forward hooks), with and without
overlapped steps, through chunked prefill, continuous batching and a prefix hit."""

from pathlib import Path

import pytest
import torch

from shared.engine.engine_request import EngineRequest
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.moe import Router, SparseMoE
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=1)


@pytest.mark.parametrize("overlap", [False, True])
def test_tokens_per_expert_are_the_routers_choices_over_a_run(checkpoint: Path, overlap: bool) -> None:
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16, async_scheduling=overlap)
    model = llm.engine.model
    assert model.config.moe is not None and model.expert_counts is not None
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    chosen = torch.zeros(len(blocks), model.config.moe.num_experts, dtype=torch.int64)
    hooks = []
    for row, block in enumerate(blocks):
        router = getattr(block, block.router_name)
        assert isinstance(router, Router)

        def record(module: Router, args: tuple, out: tuple[torch.Tensor, torch.Tensor], row: int = row) -> None:
            chosen[row] += torch.bincount(out[1].reshape(-1), minlength=chosen.shape[1])

        hooks.append(router.register_forward_hook(record))
    assert llm.engine.load().tokens_per_expert == chosen.tolist()  # zeros before any step
    prompts = random_prompts([5, 17, 23], vocab=500, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    after_first = llm.engine.load().tokens_per_expert
    assert after_first == chosen.tolist()
    # Every token of every step went through every sparse layer, top_k times, and nothing twice.
    num_tokens = sum(len(p) for p in prompts) + len(prompts) * (params.max_tokens - 1)
    assert all(sum(row) == num_tokens * model.config.moe.top_k for row in after_first)
    (hit,) = llm.generate([prompts[1][:16] + [7, 8, 9]], params)  # a prefix hit: cached tokens are not recomputed
    assert hit.num_cached_tokens == 16
    for h in hooks:
        h.remove()
    totals = llm.engine.load().tokens_per_expert
    assert totals == chosen.tolist()
    assert totals is not None and all(sum(row) == sum(first) + (3 + 5) * model.config.moe.top_k
                                      for row, first in zip(totals, after_first))  # fmt: skip


def test_dense_model_reports_no_expert_counts(tmp_path: Path) -> None:
    llm = LLM(str(save_tiny_hf_model("qwen3", tmp_path)), block_size=4)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert llm.engine.load().tokens_per_expert is None


def test_a_one_rank_engine_reports_its_windowed_expert_load(checkpoint: Path) -> None:
    """Without expert parallelism the engine still keeps its window of counts: expert_load
    (what the heartbeat and the per-layer metrics report) is one rank holding every
    expert, with every step since start in the window (shorter than its 1000 steps)."""
    llm = LLM(str(checkpoint), block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16, async_scheduling=False)
    engine = llm.engine
    empty = engine.load().expert_load
    assert empty is not None and empty.window_steps == 0 and empty.num_ranks == 1
    prompts = random_prompts([5, 17], vocab=500, seed=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), prompt, params))
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    load = engine.load()
    assert load.expert_load == engine.expert_load()
    assert load.expert_load is not None and load.tokens_per_expert is not None
    assert load.expert_load.window_steps == num_steps > 1
    assert load.expert_load.tokens_per_rank == tuple((float(sum(row)),) for row in load.tokens_per_expert)
    assert load.expert_load.balancedness() == [1.0] * len(load.tokens_per_expert)
