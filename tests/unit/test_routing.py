"""The balancer's registry and routing policies, with exact assertions."""

import random
from collections import Counter

import pytest

from services.balancer.router.policies import choose_decode, choose_prefill
from services.balancer.router.registry import MIN_INTERVAL_S, Registry
from shared.kv.block_hash import hash_block_chain
from shared.kv.events import MAX_EVENT_HASHES, kv_event_messages
from shared.proto import mesh_pb2
from tests.helpers.clock import Clock


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
    clock.now += 1.0  # d0 silent for 3.5 s > 3 missed beats: no new work, not dropped yet
    assert [i.instance_id for i in reg.live("decode")] == ["d1"]
    assert reg.num_dropped == 0 and [i.instance_id for i in reg.silent()] == ["d0", "p0"]
    # sweep() drops d0, and p0: draining still beats, and p0 has been as silent as d0.
    assert [i.instance_id for i in reg.sweep()] == ["d0", "p0"]
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
    choice = choose_prefill(reg.live("prefill"), HASHES, 64, 16, random.Random(0))
    assert choice.instance.instance_id == "p1" and choice.reason == "prefix"
    assert choice.held == {"p0": 1, "p1": 3, "p2": 0}
    assert choice.scores == {"p0": 3.0, "p1": 1.0, "p2": 4.0}  # blocks to compute, none queued
    # Evicted blocks stop counting; a restarted worker (cleared) holds nothing.
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p1", removed=HASHES[1:3]))
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p0", stored=HASHES[1:2]))
    assert choose_prefill(reg.live("prefill"), HASHES, 64, 16, random.Random(0)).instance.instance_id == "p0"
    reg.on_kv_event(mesh_pb2.KvEvent(instance_id="p0", cleared=True))
    assert choose_prefill(reg.live("prefill"), HASHES, 64, 16, random.Random(0)).held["p0"] == 0


def test_a_snapshot_replaces_the_view_and_lost_events_are_counted_as_gaps():
    reg = Registry()
    beat(reg, "prefill", "p0", num_queued_tokens=0)
    for event in kv_event_messages("p0", 1, HASHES[:2], []) + kv_event_messages("p0", 2, HASHES[2:3], []):
        reg.on_kv_event(event)
    assert reg.num_kv_event_gaps == 0
    # seq 3 (removing block 0) is lost: seq 4 comes next and the view wrongly keeps block 0.
    reg.on_kv_event(kv_event_messages("p0", 4, HASHES[3:], [])[0])
    assert reg.num_kv_event_gaps == 1
    assert choose_prefill(reg.live("prefill"), HASHES, 64, 16, random.Random(0)).held["p0"] == 4
    # The worker's snapshot says all it holds: the view is exactly that, and a snapshot
    # (cleared) never counts as a gap, whatever its number (a restarted worker starts at 1).
    snapshot = kv_event_messages("p0", 1, HASHES[1:], [], cleared=True)
    assert [e.cleared for e in snapshot] == [True]
    reg.on_kv_event(snapshot[0])
    assert reg.num_kv_event_gaps == 1
    assert choose_prefill(reg.live("prefill"), HASHES, 64, 16, random.Random(0)).held["p0"] == 0
    assert choose_prefill(reg.live("prefill"), HASHES[1:], 48, 16, random.Random(0)).held["p0"] == 3
    reg.on_kv_event(kv_event_messages("p0", 2, [], HASHES[1:2])[0])
    assert reg.num_kv_event_gaps == 1
    assert choose_prefill(reg.live("prefill"), HASHES[1:], 48, 16, random.Random(0)).held["p0"] == 0


def test_a_large_snapshot_goes_out_in_numbered_messages_the_first_one_cleared():
    stored = hash_block_chain(list(range(16 * (MAX_EVENT_HASHES + 5))), 16, "fp")
    events = kv_event_messages("p0", 7, stored, [], cleared=True)
    assert [(e.seq, e.cleared, len(e.stored)) for e in events] == [(7, True, MAX_EVENT_HASHES), (8, False, 5)]
    assert [h for e in events for h in e.stored] == stored
    assert all(e.ByteSize() < 1 << 20 for e in events)  # NATS's default max payload
    assert kv_event_messages("p0", 1, [], []) == []  # nothing to say, nothing sent
    assert [e.cleared for e in kv_event_messages("p0", 1, [], [], cleared=True)] == [True]  # an empty cache


def test_prefill_misses_go_to_the_least_queued_and_ties_are_random():
    reg = Registry()
    beat(reg, "prefill", "p0", num_queued_tokens=500)
    beat(reg, "prefill", "p1", num_queued_tokens=20)
    beat(reg, "prefill", "p2", num_queued_tokens=20)
    picks = Counter(
        choose_prefill(reg.live("prefill"), HASHES, 64, 16, random.Random(seed)).instance.instance_id for seed in range(200)
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
        choose_prefill([], HASHES, 64, 16, random.Random(0))


def test_a_heartbeat_claiming_an_interval_beyond_the_bound_is_refused_and_counted():
    clock = Clock()
    reg = Registry(misses=3, clock=clock, max_interval_s=5.0)
    for iid, interval in (("forever", 1e9), ("nan", float("nan")), ("inf", float("inf")), ("negative", -1.0)):
        hb = mesh_pb2.Heartbeat(stage="decode", instance_id=iid, seq=1, interval_s=interval)
        assert reg.on_heartbeat(hb) == "interval"
    assert reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id="a.b", seq=1)) == "instance_id"
    assert reg.on_heartbeat(mesh_pb2.Heartbeat(stage="embedder", instance_id="v", seq=1)) == "stage"  # no such stage
    # The subject names the stage: a decode heartbeat on prefill's subject is refused.
    assert reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id="d", seq=1), stage="prefill") == "stage"
    assert reg.num_refused == {"interval": 4, "instance_id": 1, "stage": 2}
    assert reg.live("decode") == []
    # At the bound it is taken; below the floor it is read as the floor (50 ms).
    assert reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id="slow", seq=1, interval_s=5.0)) is None
    assert reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id="fast", seq=1, interval_s=1e-6)) is None
    assert reg.get("fast").interval_s == MIN_INTERVAL_S
    clock.now += 3 * MIN_INTERVAL_S + 0.001
    assert [i.instance_id for i in reg.live("decode")] == ["slow"]
    # A checked stream chunk is proof of life: fast is back.
    reg.touch("fast")
    assert sorted(i.instance_id for i in reg.live("decode")) == ["fast", "slow"]


def test_leaving_instances_are_announced_once_with_why_and_a_restart_is_a_leave():
    clock = Clock()
    reg = Registry(misses=3, clock=clock)
    left: list[tuple[str, str]] = []
    reg.on_removed.append(lambda inst, why: left.append((inst.instance_id, why)))
    for iid in ("d0", "d1"):
        reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id=iid, seq=1, interval_s=0.2))
    clock.now += 0.5
    reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id="d1", seq=2, interval_s=0.2))
    clock.now += 0.2  # d0 silent for 0.7 s > 3 * 0.2 s
    assert [i.instance_id for i in reg.sweep()] == ["d0"]
    assert reg.sweep() == [] and left == [("d0", "missed 3 heartbeats")]
    # d1's seq goes back: a new process under the old name, whose predecessor's work is gone.
    reg.on_heartbeat(mesh_pb2.Heartbeat(stage="decode", instance_id="d1", seq=1, interval_s=0.2))
    assert left[-1] == ("d1", "restarted") and reg.get("d1") is not None and reg.get("d1").seq == 1
    assert reg.num_dropped == 2
