"""The live EPLB balancer (shared/engine/eplb/balancer.py) and its settings, torch-free:
a placement computed off the step loop every step_interval steps, handed out one
changed layer per step until the ranks run it, never losing an expert; with EPLB
off it only measures. EngineConfig refuses what EPLB cannot mean."""

import time

import numpy as np
import pytest

from shared.engine.config import EngineConfig, EplbConfig
from shared.engine.eplb.balancer import ExpertBalancer
from shared.engine.eplb.expert_load import ExpertLoad
from shared.engine.eplb.load_window import balancedness
from shared.engine.eplb.placement import compute_placement

LAYERS, EXPERTS, RANKS = 3, 8, 2
SKEWED = np.array([[40, 1, 15, 0, 9, 1, 25, 3], [1, 30, 2, 30, 1, 1, 1, 20], [5, 5, 5, 5, 5, 5, 5, 5]])


def _drain(balancer: ExpertBalancer, steps: int) -> list[int]:
    """Record SKEWED for up to ``steps`` steps; the layers moved, in order."""
    moved = []
    for _ in range(steps):
        balancer.record(SKEWED)
        move = balancer.next_move()
        if move is not None:
            moved.append(move.layer)
            assert sorted(set(move.slot_experts)) == list(range(EXPERTS))  # no expert lost
            assert len(move.slot_experts) == EXPERTS + 2
        time.sleep(0.005)  # the placement thread's turn
    return moved


def test_a_new_placement_is_applied_one_layer_per_step_and_balances_the_load() -> None:
    settings = EplbConfig(window_size=4, step_interval=3, num_redundant_experts=2)
    balancer = ExpertBalancer(LAYERS, EXPERTS, RANKS, settings, rebalance=True)
    before = balancer.expert_load()
    assert before.window_steps == 0 and before.num_redundant_experts == 2
    start = balancer.placement.phy_to_log.copy()
    assert start[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # slot s holds s % experts
    moved = _drain(balancer, 40)
    changed = [layer for layer in range(LAYERS) if (balancer.placement.phy_to_log[layer] != start[layer]).any()]
    assert changed and moved[: len(changed)] == changed  # each changed layer once, in order, one per step
    assert balancer.num_rebalances == 1  # the later placements, of the same load, are the one running
    load = balancer.expert_load()
    assert load.window_steps == 4 and len(load.tokens_per_rank) == LAYERS
    assert load.tokens_per_rank[0] and sum(load.tokens_per_rank[0]) == pytest.approx(4 * SKEWED[0].sum())
    # The ranks run what EPLB places for this load, and report its balancedness.
    target = compute_placement(4 * SKEWED, balancer.spec)
    assert np.array_equal(balancer.placement.phy_to_log, target.phy_to_log)
    assert load.balancedness() == pytest.approx(list(balancedness(4 * SKEWED, target)))
    static = ExpertBalancer(LAYERS, EXPERTS, RANKS, EplbConfig(window_size=4, num_redundant_experts=2), rebalance=False)
    for _ in range(4):
        static.record(SKEWED)
    assert load.balancedness()[0] > static.expert_load().balancedness()[0]  # the skewed layer, better balanced
    balancer.close()


def test_with_eplb_off_the_placement_never_moves() -> None:
    balancer = ExpertBalancer(LAYERS, EXPERTS, RANKS, EplbConfig(step_interval=1), rebalance=False)
    assert _drain(balancer, 5) == []
    load = balancer.expert_load()
    assert load.num_rebalances == 0 and load.window_steps == 5
    # The static split: rank 0 holds experts 0-3, rank 1 experts 4-7.
    assert load.tokens_per_rank[0] == (5.0 * SKEWED[0, :4].sum(), 5.0 * SKEWED[0, 4:].sum())


def test_one_rank_reports_the_windows_tokens_and_the_oldest_step_drops_out() -> None:
    """A one-rank engine's balancer (no expert parallelism) only measures: every layer's
    tokens over the last window_size steps, on its one rank."""
    balancer = ExpertBalancer(2, 3, 1, EplbConfig(window_size=2), rebalance=False)
    assert balancer.expert_load() == ExpertLoad([[0.0], [0.0]], 0)
    for step in ([[1, 2, 0], [0, 0, 4]], [[0, 5, 0], [1, 1, 1]], [[7, 0, 0], [0, 2, 0]]):
        balancer.record(np.array(step))
        assert balancer.next_move() is None
    # Steps 2 and 3 in the window; step 1 fell out.
    assert balancer.expert_load() == ExpertLoad([[12.0], [5.0]], 2)
    assert balancer.expert_load().balancedness() == [1.0, 1.0]
    balancer.close()


EP = dict(tensor_parallel_size=2, enable_expert_parallel=True)
EPLB = dict(EP, enable_eplb=True)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(enable_expert_parallel=True), "set tensor_parallel_size or data_parallel_size > 1"),
        (dict(tensor_parallel_size=2, enable_eplb=True), "set enable_expert_parallel"),
        (dict(EP, eplb_config='{"window_size": 5}'), "enable_eplb is off"),
        (dict(EPLB, eplb_config='{"window": 5}'), r"unknown keys \['window'\]"),
        (dict(EPLB, eplb_config='{"step_interval": 0}'), "step_interval must be >= 1"),
        (dict(EPLB, eplb_config='{"window_size": "5"}'), "whole number"),
        (dict(EPLB, eplb_config='[1, 2]'), "a JSON object"),
        (dict(EPLB, eplb_config='{"blocking_moves": 1}'), r"\['blocking_moves'\] are true or false"),
        (dict(EPLB, eplb_config='{"window_size": true}'), "whole number"),
    ],
)
def test_expert_parallel_settings_that_mean_nothing_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_eplb_config_reads_vllm_keys() -> None:
    config = EngineConfig(**EPLB, eplb_config='{"window_size": 10, "step_interval": 20, "num_redundant_experts": 4}')
    assert config.eplb_settings() == EplbConfig(window_size=10, step_interval=20, num_redundant_experts=4)
    assert EngineConfig().eplb_settings() == EplbConfig()
    blocking = EngineConfig(**EPLB, eplb_config='{"blocking_moves": true}').eplb_settings()
    assert blocking.blocking_moves and not EplbConfig().blocking_moves
