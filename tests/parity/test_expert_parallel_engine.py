"""Expert parallelism through the engine (issue 28): MoE models run over 2 (and 4) real
gloo worker processes with ``enable_expert_parallel`` generate the single process's
tokens and logprobs, and with ``enable_eplb`` the experts move between the ranks
mid-generation, in the background beside the steps, without changing a token.

Qwen3-MoE and GPT-OSS run their attention, dense MLPs, embedding and head
tensor-parallel over the ranks (vLLM's `--tensor-parallel-size N
--enable-expert-parallel`), DeepSeek-V4 too (its query heads; its KV whole on every
rank). o_proj's (and down_proj's) all-reduce sums partial products in another order than one matmul, and
in default mode a rank's router and experts run matmuls over other row counts than
one process does (BLAS picks its reduction order by shape), so in every mode the
logprobs agree within LOGPROB_TOLERANCE (measured here: 4.8e-7 for every case,
batch-invariant or not, 2 or 4 ranks) and the greedy tokens of these seeded prompts
are equal. EPLB's moves are compared with EP without them, both tensor-parallel in
batch-invariant mode: bitwise equal (each MoE layer's slice of tokens is computed by
per-row-invariant kernels wherever its experts live; the all-gather is a copy; the
attention's all-reduces see the same inputs).
"""

import json
import math
import multiprocessing
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from shared.engine.eplb.placement import PlacementSpec, initial_placement
from shared.engine.executor import expert_mover
from shared.engine.executor.move_schedule import MoveSchedule
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.expert_parallel_model import layer_slots
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
LOGPROB_TOLERANCE = 1e-4
"""|EP - single| of a sampled token's logprob, in every mode (module docstring)."""
ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
"""Small blocks and chunks: prompts span blocks, prefill is chunked beside decoding."""
PROMPTS = random_prompts([5, 17, 11], vocab=500, seed=3)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ep-engine")
    return {
        "qwen3_moe": str(save_tiny_hf_model("qwen3_moe", root / "qwen3_moe", seed=1)),
        "gpt_oss": str(save_tiny_hf_model("gpt_oss", root / "gpt_oss", seed=1)),
        "deepseek_v4": str(save_tiny_v4("mixed", root / "v4", seed=1)),  # a hash-routed layer, then top-k ones
    }


def _generate(model: str, params: SamplingParams = GREEDY, **settings: Any) -> tuple[list[list[int]], list[list[float]]]:  # noqa: E501
    llm = LLM(model, **ENGINE, **settings)
    try:
        outputs = llm.generate(PROMPTS, params)
    finally:
        llm.engine.close()
    return [o.token_ids for o in outputs], [_chosen_logprobs(o) for o in outputs]


def _chosen_logprobs(output: Any) -> list[float]:
    assert [step.token_id for step in output.logprobs] == output.token_ids
    return [step.logprob for step in output.logprobs]


@pytest.mark.parametrize(
    ("family", "invariant", "ranks"),
    [
        ("qwen3_moe", True, 2),
        ("gpt_oss", True, 2),
        ("gpt_oss", False, 2),
        ("qwen3_moe", False, 2),
        ("deepseek_v4", False, 2),
        ("qwen3_moe", True, 4),
    ],
)
def test_expert_parallel_generates_the_tokens_of_one_process(
    models: dict[str, str], family: str, invariant: bool, ranks: int
) -> None:
    mode = dict(batch_invariant=True) if invariant else {}
    tokens, logprobs = _generate(models[family], **mode)
    ep_tokens, ep_logprobs = _generate(models[family], tensor_parallel_size=ranks, enable_expert_parallel=True,
                                       **mode)  # fmt: skip
    assert ep_tokens == tokens
    worst = max(abs(a - b) for one, ep in zip(logprobs, ep_logprobs) for a, b in zip(one, ep))
    print(f"{family} invariant={invariant} ranks={ranks}: worst |EP - single| logprob {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_eplb_moves_experts_mid_generation_and_keeps_the_tokens(models: dict[str, str], family: str) -> None:
    """Tensor-parallel attention beside the expert-parallel MoE layers (2 ranks), a
    placement every 3 steps from a window of 4, one redundant expert per rank; with
    greedy and seeded sampled requests over overlapped steps. The tokens and logprobs are
    bitwise those of EP without EPLB (batch-invariant mode); the engine handed out layer
    moves, every rank ran them (rank 0's layers hold what the balancer says, and a
    worker that moved otherwise would have computed other tokens), and every layer of
    every placement kept every expert."""
    model = models[family]
    prompts = random_prompts([5, 17, 33, 9], vocab=500, seed=4)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1),
    ]
    common = dict(tensor_parallel_size=2, enable_expert_parallel=True, batch_invariant=True, async_scheduling=True,
                  **ENGINE)  # fmt: skip
    plain = LLM(model, **common)
    try:
        expected = plain.generate(prompts, params)
    finally:
        plain.engine.close()

    llm = LLM(model, enable_eplb=True, eplb_config='{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}',
              **common)  # fmt: skip
    try:
        got = llm.generate(prompts, params)
        engine = llm.engine
        balancer = engine._experts
        assert balancer is not None
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [_chosen_logprobs(o) for o in got] == [_chosen_logprobs(o) for o in expected]
        assert engine.model.parallel.tp_size == 2  # type: ignore[attr-defined]
        num_layers = {"qwen3_moe": 2, "gpt_oss": 3}[family]  # sparse layers
        assert balancer.placement.num_layers == num_layers
        start = initial_placement(num_layers, 8, PlacementSpec(2, 2)).phy_to_log
        assert balancer.num_layer_moves >= 2, "no expert moved during the generation"
        assert (balancer.placement.phy_to_log != start).any()
        # The balancer counts a move from when it hands it out; the last one may still wait
        # to start, or be in flight, for a next step that never came.
        pending = engine.executor.moves.unswitched  # type: ignore[attr-defined]
        for layer in range(balancer.placement.num_layers):
            slots = layer_slots(engine.model, layer)
            if pending is not None and pending.layer == layer:
                assert list(pending.slot_experts) == balancer.placement.phy_to_log[layer].tolist()
            else:
                assert slots == balancer.placement.phy_to_log[layer].tolist()
            assert len(slots) == 10 and sorted(set(slots)) == list(range(8))  # 5 slots a rank; no expert lost
        load = engine.expert_load()
        assert load is not None and load.num_ranks == 2 and load.num_redundant_experts == 2
        assert len(load.balancedness()) == num_layers and all(0.0 < b <= 1.0 for b in load.balancedness())
        assert all(len(per_rank) == 2 and sum(per_rank) > 0 for per_rank in load.tokens_per_rank)
        for per_rank, b in zip(load.tokens_per_rank, load.balancedness()):
            assert math.isclose(b, sum(per_rank) / 2 / max(per_rank))
    finally:
        llm.engine.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_eplb_moves_run_beside_the_steps_and_switch_on_every_rank_at_one_step(
    models: dict[str, str], monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """In the background, rank 0's move of a layer is held until rank 0 ordered the step
    after the one that started it (and so is every rank's: the all-to-all waits for
    rank 0), so each move runs beside at least one step, whatever the machine's speed.
    The tokens and logprobs stay bitwise those of EP without EPLB, which they would not
    were any rank to switch a layer at another step than the others (its slots would
    hold other experts than rank 0 dispatches to). Blocking moves (``blocking_moves``)
    keep the tokens too, and no step runs beside a move."""
    model = models["qwen3_moe"]
    prompts = random_prompts([5, 17, 33, 9], vocab=500, seed=4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)
    common = dict(tensor_parallel_size=2, enable_expert_parallel=True, batch_invariant=True, **ENGINE)
    plain = LLM(model, **common)
    try:
        expected = plain.generate(prompts, params)
    finally:
        plain.engine.close()

    if not blocking:  # rank 0 is this process: its step orders are counted, its mover held
        orders = threading.Condition()
        ordered = [0]
        order, move_layer_weights = MoveSchedule.order, expert_mover.move_layer_weights

        def counted_order(self: MoveSchedule, moved_everywhere: bool) -> Any:
            with orders:  # the caller read moved_everywhere (False while held) before this call
                ordered[0] += 1
                orders.notify_all()
            return order(self, moved_everywhere)

        def held_move(*args: Any) -> Any:
            with orders:  # started once the starting step's order was made: wait for the next one
                began = ordered[0]
                orders.wait_for(lambda: ordered[0] > began, timeout=10.0)  # the last move may see none
            return move_layer_weights(*args)

        monkeypatch.setattr(MoveSchedule, "order", counted_order)
        monkeypatch.setattr(expert_mover, "move_layer_weights", held_move)
    settings = {"window_size": 4, "step_interval": 3, "num_redundant_experts": 2, "blocking_moves": blocking}
    llm = LLM(model, enable_eplb=True, eplb_config=json.dumps(settings), **common)
    try:
        got = llm.generate(prompts, params)
        engine = llm.engine
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [_chosen_logprobs(o) for o in got] == [_chosen_logprobs(o) for o in expected]
        moves = engine.executor.moves  # type: ignore[attr-defined]
        balancer = engine._experts
        assert balancer is not None and moves.num_switches >= 2
        assert moves.num_switches == balancer.num_layer_moves - (moves.unswitched is not None)
        if blocking:
            assert moves.steps_beside_moves == 0
        else:
            assert moves.steps_beside_moves >= moves.num_switches  # each move outlived at least one step
    finally:
        llm.engine.close()
    assert multiprocessing.active_children() == []


def test_closing_mid_move_waits_for_the_movers_and_exits_cleanly(models: dict[str, str]) -> None:
    """An engine closed while every rank's mover is in its move's collectives (rank 0's
    held until close() began: tests/helpers/eplb_close_mid_move.py) exits 0, and no rank
    aborts at exit: close() waits for the movers before the ranks and their groups go."""
    done = subprocess.run([sys.executable, "-m", "tests.helpers.eplb_close_mid_move", models["qwen3_moe"]],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "closed mid-move" in done.stdout
    assert "terminate called" not in done.stderr, done.stderr


def test_what_expert_parallelism_does_not_run_is_refused_before_any_rank_starts(
    models: dict[str, str], tmp_path: Path
) -> None:
    dense = save_tiny_hf_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs an MoE model: LlamaForCausalLM"):
        LLM(str(dense), tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"8 experts \+ 0 redundant do not divide over 3 ranks"):
        LLM(models["qwen3_moe"], tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"8 experts \+ 1 redundant do not divide over 2 ranks"):
        LLM(models["qwen3_moe"], tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
            eplb_config='{"num_redundant_experts": 1}')  # fmt: skip
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(8\)"):
        LLM(models["qwen3_moe"], tensor_parallel_size=8, enable_expert_parallel=True)  # 8 experts split, 4 heads not
    with pytest.raises(ValueError, match=r"tensor parallelism for Qwen3MoeForCausalLM \(MoE layers\) without "
                                         r"enable_expert_parallel"):  # fmt: skip
        LLM(models["qwen3_moe"], tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"not implemented yet: speculative decoding with tensor_parallel_size > 1"):
        LLM(models["qwen3_moe"], tensor_parallel_size=2, enable_expert_parallel=True, speculative="ngram")
    assert multiprocessing.active_children() == []
