"""The EP load balancer (services/balancer/router/policies.py): among MoE instances,
whose heartbeats carry their per-layer expert load, the one whose next step is
shortest, counting how unevenly its experts' tokens sit on its ranks. Exact choices,
each one that a balancedness-blind policy would make differently."""

import random

import pytest

from services.balancer.router.policies import (
    choose_decode,
    choose_expert_parallel,
    choose_prefill,
    serves_expert_parallel,
    step_balancedness,
)
from services.balancer.router.registry import Registry
from shared.engine.eplb.expert_load import ExpertLoad
from shared.kv.block_hash import hash_block_chain
from shared.proto import mesh_pb2
from shared.stage.convert import expert_load_to_proto


def beat(reg: Registry, stage: str, iid: str, tokens_per_rank: list[list[int]] | None = None, **load: int) -> None:
    msg = mesh_pb2.Load(**load)
    if tokens_per_rank is not None:
        msg.expert_load.CopyFrom(expert_load_to_proto(ExpertLoad(tokens_per_rank, window_steps=10)))
    reg.on_heartbeat(mesh_pb2.Heartbeat(stage=stage, instance_id=iid, interval_s=1.0, load=msg))


EVEN = [[25, 25, 25, 25], [25, 25, 25, 25]]
SKEWED = [[25, 25, 25, 25], [70, 10, 10, 10]]
"""Layer 1's all-to-all waits for a rank with 70 of its 100 tokens: the step's expert
compute takes 25 + 70 where even ranks would take 25 + 25."""


def test_step_balancedness_sums_the_layers_busiest_ranks() -> None:
    reg = Registry()
    beat(reg, "decode", "even", EVEN)
    beat(reg, "decode", "skewed", SKEWED)
    beat(reg, "decode", "dense")
    beat(reg, "decode", "idle", [[0, 0], [0, 0]])
    assert step_balancedness(reg.get("even")) == 1.0
    assert step_balancedness(reg.get("skewed")) == pytest.approx(50 / 95)
    assert step_balancedness(reg.get("dense")) == 1.0  # no expert load: counts as balanced
    assert step_balancedness(reg.get("idle")) == 1.0
    assert serves_expert_parallel(reg.live("decode"))
    assert not serves_expert_parallel([reg.get("dense")])


def test_decode_goes_to_the_balanced_instance_though_it_runs_more() -> None:
    reg = Registry()
    beat(reg, "decode", "skewed", SKEWED, num_running=1, num_free_kv_blocks=100)
    beat(reg, "decode", "even", EVEN, num_running=1, num_free_kv_blocks=50)
    # Equal load: the least-loaded policy would pick the roomier, skewed instance.
    assert choose_decode(reg.live("decode"), random.Random(0)).instance.instance_id == "skewed"
    choice = choose_expert_parallel(reg.live("decode"), random.Random(0))
    assert choice.instance.instance_id == "even" and choice.reason == "expert_balance"
    assert choice.scores == {"skewed": pytest.approx(2 / (50 / 95)), "even": 2.0}
    # One more request on the even instance (3 with this one) still beats the skewed one (3.8).
    beat(reg, "decode", "even", EVEN, num_running=2, num_free_kv_blocks=50)
    assert choose_expert_parallel(reg.live("decode"), random.Random(0)).instance.instance_id == "even"
    # Two more (4) do not: load wins over balance there.
    beat(reg, "decode", "even", EVEN, num_running=3, num_free_kv_blocks=50)
    assert choose_expert_parallel(reg.live("decode"), random.Random(0)).instance.instance_id == "skewed"


def test_requests_sent_since_the_last_heartbeat_count() -> None:
    reg = Registry()
    beat(reg, "decode", "a", EVEN)
    beat(reg, "decode", "b", EVEN)
    first = choose_expert_parallel(reg.live("decode"), random.Random(0)).instance
    first.in_flight += 1
    second = choose_expert_parallel(reg.live("decode"), random.Random(0)).instance
    assert {first.instance_id, second.instance_id} == {"a", "b"}
    with pytest.raises(LookupError):
        choose_expert_parallel([], random.Random(0))


def test_prefill_without_a_prefix_hit_weighs_queued_tokens_by_balance() -> None:
    reg = Registry()
    beat(reg, "prefill", "skewed", SKEWED, num_queued_tokens=100)
    beat(reg, "prefill", "even", EVEN, num_queued_tokens=150)
    hashes = hash_block_chain(list(range(32)), 16, "fp")
    choice = choose_prefill(reg.live("prefill"), hashes, 32, 16, random.Random(0))
    # 100 queued tokens at 50/95 weigh 190 (11.875 blocks): more than 150 evenly spread
    # (9.375), beside the prompt's 2 blocks to compute on either.
    assert choice.instance.instance_id == "even" and choice.reason == "expert_balance"
    assert choice.scores == {"skewed": pytest.approx(2 + 190 / 16), "even": 2 + 150 / 16}
    # A prefix hit is worth its blocks of queue: the 2 held outweigh 2.5 blocks' difference
    # at weight 2, not at weight 1.
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="skewed", stored=hashes))
    assert choose_prefill(reg.live("prefill"), hashes, 32, 16, random.Random(0), 2.0).instance.instance_id == "skewed"
    assert choose_prefill(reg.live("prefill"), hashes, 32, 16, random.Random(0), 1.0).instance.instance_id == "even"
