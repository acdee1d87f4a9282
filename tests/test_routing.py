"""The balancer's registry and routing policies, with exact assertions."""

import random
from collections import Counter

import pytest

from services.balancer.policies import choose_decode, choose_prefill
from services.balancer.registry import Registry
from shared.kv.block_hash import hash_block_chain
from shared.proto import mesh_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(reg: Registry, stage: str, iid: str, draining: bool = False, **load) -> None:
    reg.on_heartbeat(
        mesh_pb2.Heartbeat(stage=stage, instance_id=iid, interval_s=1.0, draining=draining, load=mesh_pb2.Load(**load))
    )


def test_instances_missing_heartbeats_are_dropped_and_draining_ones_get_no_work():
    clock = Clock()
    reg = Registry(misses=3, clock=clock)
    beat(reg, "decode", "d0")
    beat(reg, "decode", "d1")
    beat(reg, "prefill", "p0", draining=True)
    assert sorted(i.instance_id for i in reg.live("decode")) == ["d0", "d1"]
    assert reg.live("prefill") == []
    clock.now += 2.5
    beat(reg, "decode", "d1")
    clock.now += 1.0  # d0 silent for 3.5 s > 3 missed beats
    assert [i.instance_id for i in reg.live("decode")] == ["d1"]
    # d0, and p0: draining still beats, and p0 has been as silent as d0.
    assert reg.num_dropped == 2 and reg.get("p0") is None


HASHES = hash_block_chain(list(range(64)), 16, "fp")  # 4 blocks


def test_prefill_goes_to_the_instance_holding_most_leading_blocks():
    reg = Registry()
    for iid in ("p0", "p1", "p2"):
        beat(reg, "prefill", iid, num_queued_tokens=0)
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p0", stored=HASHES[:1]))
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p1", stored=HASHES[:3]))
    # p2 holds blocks 1..3 but not block 0: a chain only counts from its start.
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p2", stored=HASHES[1:]))
    choice = choose_prefill(reg.live("prefill"), HASHES, random.Random(0))
    assert choice.instance.instance_id == "p1" and choice.reason == "prefix"
    assert choice.scores == {"p0": 1.0, "p1": 3.0, "p2": 0.0}
    # Evicted blocks stop counting; a restarted worker (cleared) holds nothing.
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p1", removed=HASHES[1:3]))
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p0", stored=HASHES[1:2]))
    assert choose_prefill(reg.live("prefill"), HASHES, random.Random(0)).instance.instance_id == "p0"
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p0", cleared=True))
    assert choose_prefill(reg.live("prefill"), HASHES, random.Random(0)).scores["p0"] == 0.0


def test_prefill_misses_go_to_the_least_queued_and_ties_are_random():
    reg = Registry()
    beat(reg, "prefill", "p0", num_queued_tokens=500)
    beat(reg, "prefill", "p1", num_queued_tokens=20)
    beat(reg, "prefill", "p2", num_queued_tokens=20)
    picks = Counter(
        choose_prefill(reg.live("prefill"), HASHES, random.Random(seed)).instance.instance_id for seed in range(200)
    )
    assert picks["p0"] == 0
    assert picks["p1"] > 60 and picks["p2"] > 60  # both tied instances get work


def test_in_flight_dispatches_count_until_the_next_heartbeat():
    reg = Registry()
    beat(reg, "decode", "d0", num_running=1, num_free_kv_blocks=100)
    beat(reg, "decode", "d1", num_running=1, num_free_kv_blocks=100)
    rng = random.Random(1)
    first = choose_decode(reg.live("decode"), rng).instance
    first.in_flight += 1  # what the orchestrator does on an accepted dispatch
    second = choose_decode(reg.live("decode"), rng).instance
    assert second is not first  # a burst spreads instead of piling on one instance
    beat(reg, "decode", first.instance_id, num_running=2, num_free_kv_blocks=90)
    assert reg.get(first.instance_id).in_flight == 0


def test_decode_prefers_fewer_requests_then_more_free_blocks():
    reg = Registry()
    beat(reg, "decode", "busy", num_running=5, num_free_kv_blocks=900)
    beat(reg, "decode", "full", num_running=1, num_free_kv_blocks=10)
    beat(reg, "decode", "roomy", num_running=1, num_free_kv_blocks=800)
    assert choose_decode(reg.live("decode"), random.Random(0)).instance.instance_id == "roomy"


def test_no_instance_is_a_lookup_error():
    with pytest.raises(LookupError, match="no live decode"):
        choose_decode([], random.Random(0))
    with pytest.raises(LookupError, match="no live prefill"):
        choose_prefill([], HASHES, random.Random(0))
