"""An MoE instance's expert load on its way to the balancer (issue 28, the EP balancer):
ExpertLoad's per-layer figures, the heartbeat's wire form, and the worker's per-layer
gauges, with exact values. The window the load covers is the engine's
(test_eplb_balancer.py, test_expert_counts.py)."""

import pytest

from shared.engine.eplb.placement import static_placement
from shared.engine.eplb.expert_load import ExpertLoad
from shared.proto import mesh_pb2
from shared.runtime.metrics import Metrics
from shared.stage.convert import expert_load_to_proto
from shared.stage.expert_metrics import ExpertLoadMetrics

# Layer 0 even over 4 ranks; layer 1 with one hot rank; layer 2 got no tokens.
LOAD = ExpertLoad(tokens_per_rank=[[10, 10, 10, 10], [40, 10, 5, 5], [0, 0, 0, 0]], window_steps=7)


def test_balancedness_is_mean_over_max_per_layer_and_one_for_an_idle_layer() -> None:
    assert LOAD.mean_tokens_per_rank() == [10.0, 15.0, 0.0]
    assert LOAD.max_tokens_per_rank() == [10, 40, 0]
    assert LOAD.balancedness() == [1.0, 15 / 40, 1.0]
    assert (LOAD.num_layers, LOAD.num_ranks) == (3, 4)


def test_from_expert_counts_sums_each_ranks_experts_under_the_placement() -> None:
    counts = [[1, 2, 3, 4], [8, 0, 0, 0]]  # [layer][expert]
    one_process = ExpertLoad.from_expert_counts(counts, window_steps=3, placement=static_placement(2, 4, 1))
    assert one_process == ExpertLoad([[10], [8]], 3)
    assert one_process.balancedness() == [1.0, 1.0]
    # Experts 0-1 on rank 0, 2-3 on rank 1.
    two_ranks = ExpertLoad.from_expert_counts(counts, window_steps=3, placement=static_placement(2, 4, 2))
    assert two_ranks == ExpertLoad([[3, 7], [8, 0]], 3)
    assert two_ranks.balancedness() == [5 / 7, 0.5]
    with pytest.raises(ValueError, match="layers, experts"):
        ExpertLoad.from_expert_counts([1, 2, 3], window_steps=1, placement=static_placement(1, 3, 1))


def test_the_heartbeat_carries_per_layer_mean_max_and_balancedness() -> None:
    hb = mesh_pb2.Heartbeat(stage="decode", instance_id="d0",
                            load=mesh_pb2.Load(num_running=2, expert_load=expert_load_to_proto(LOAD)))  # fmt: skip
    back = mesh_pb2.Heartbeat.FromString(hb.SerializeToString()).load
    assert back.num_running == 2 and back.HasField("expert_load")
    assert (back.expert_load.num_ranks, back.expert_load.window_steps) == (4, 7)
    layers = back.expert_load.layers
    assert [layer.mean_tokens_per_rank for layer in layers] == [10.0, 15.0, 0.0]
    assert [layer.max_tokens_per_rank for layer in layers] == [10, 40, 0]
    assert [layer.balancedness for layer in layers] == [1.0, 15 / 40, 1.0]
    assert (back.expert_load.num_rebalances, back.expert_load.num_redundant_experts) == (0, 0)
    rebalanced = ExpertLoad(LOAD.tokens_per_rank, 7, num_rebalances=3, num_redundant_experts=4)
    wire = mesh_pb2.ExpertLoad.FromString(expert_load_to_proto(rebalanced).SerializeToString())
    assert (wire.num_rebalances, wire.num_redundant_experts) == (3, 4)
    # A dense model's load says nothing of experts.
    assert not mesh_pb2.Load.FromString(mesh_pb2.Load(num_running=1).SerializeToString()).HasField("expert_load")


def test_the_gauges_say_each_layers_figures() -> None:
    metrics = Metrics("decode")
    gauges = ExpertLoadMetrics(metrics)
    gauges.update(LOAD)
    r = metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return r.get_sample_value(f"infermesh_decode_{name}", labels)

    assert [value("eplb_balancedness", layer=str(i)) for i in range(3)] == [1.0, 15 / 40, 1.0]
    assert [value("expert_tokens_per_rank_mean", layer=str(i)) for i in range(3)] == [10.0, 15.0, 0.0]
    assert [value("expert_tokens_per_rank_max", layer=str(i)) for i in range(3)] == [10.0, 40.0, 0.0]
    assert (value("expert_parallel_ranks"), value("eplb_window_steps")) == (4.0, 7.0)
    gauges.update(ExpertLoad([[5, 5, 5, 5], [5, 5, 5, 5], [20, 0, 0, 0]], 2))  # the next window's figures replace them
    assert [value("eplb_balancedness", layer=str(i)) for i in range(3)] == [1.0, 1.0, 0.25]


def test_the_rebalance_counter_follows_the_engines_count() -> None:
    """The engine counts its applied placements since it started; the counter advances by
    what is new at each heartbeat, and a repeated count adds nothing."""
    metrics = Metrics("prefill")
    gauges = ExpertLoadMetrics(metrics)

    def rebalances() -> float | None:
        return metrics.registry.get_sample_value("infermesh_prefill_eplb_rebalances_total", {})

    gauges.update(LOAD)
    assert rebalances() == 0.0
    for engine_count in (2, 2, 5):
        gauges.update(ExpertLoad(LOAD.tokens_per_rank, 7, num_rebalances=engine_count))
    assert rebalances() == 5.0
