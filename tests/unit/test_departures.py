"""Who may speak for an instance, in the registry: a heartbeat or KV event whose
body names another instance than its subject is refused and counted; a closed
NATS connection makes its instance leave at once, but only when the
connection's user could have been that instance. (Real advisories from a real
nats-server: tests/mesh/test_trust.py; a real kill under load: tests/mesh/test_failover.py.)"""

import json

from services.balancer.router.departures import Departure, instance_departed, parse_advisory
from services.balancer.router.registry import Registry
from shared.proto import mesh_pb2


def beat(instance_id: str, stage: str = "decode", seq: int = 1) -> mesh_pb2.Heartbeat:
    return mesh_pb2.Heartbeat(stage=stage, instance_id=instance_id, seq=seq, interval_s=0.5)


def advisory(name: str, user: str, kind: str = "client_disconnect") -> bytes:
    return json.dumps({"type": f"io.nats.server.advisory.v1.{kind}", "reason": "Client Closed",
                       "client": {"name": name, "user": user, "acc": "MESH"}}).encode()


def test_a_heartbeat_or_kv_event_in_another_instances_name_is_refused_and_counted():
    reg = Registry()
    assert reg.on_heartbeat(beat("decode-0"), "decode", "decode-0") is None
    # decode-1's subject, decode-0's name (draining, a seq far ahead): nothing of it is taken.
    forged = beat("decode-0", seq=1 << 40)
    forged.draining = True
    assert reg.on_heartbeat(forged, "decode", "decode-1") == "instance_mismatch"
    assert reg.get("decode-1") is None and not reg.get("decode-0").draining and reg.get("decode-0").seq == 1
    assert reg.on_kv_event(mesh_pb2.KvEvent(instance_id="decode-0", stored=[b"\x01" * 32]), "decode-1") \
        == "kv_instance_mismatch"
    assert reg.get("decode-0").blocks == set()
    assert reg.on_kv_event(mesh_pb2.KvEvent(instance_id="decode-0", stored=[b"\x01" * 32]), "decode-0") is None
    assert reg.get("decode-0").blocks == {b"\x01" * 32}
    assert reg.num_refused == {"instance_mismatch": 1, "kv_instance_mismatch": 1}


def test_a_disconnect_advisory_is_parsed_and_anything_else_is_not():
    assert parse_advisory(advisory("decode-0", "decode-0")) == Departure("decode-0", "decode-0", "Client Closed")
    assert parse_advisory(advisory("decode-0", "decode-0", kind="client_connect")) is None
    assert parse_advisory(b"\xff not json") is None
    assert parse_advisory(b'["a list"]') is None
    assert parse_advisory(json.dumps({"type": "io.nats.server.advisory.v1.client_disconnect",
                                      "client": {"user": "decode-0"}}).encode()) is None  # no name


def test_a_closed_connection_removes_its_instance_only_when_its_user_could_be_that_instance():
    reg = Registry()
    left: list[tuple[str, str]] = []
    reg.on_removed.append(lambda inst, why: left.append((inst.instance_id, why.split(" ")[0])))
    for iid, stage in (("decode-0", "decode"), ("decode-1", "decode"), ("decode-abc", "decode"),
                       ("prefill-0", "prefill")):
        reg.on_heartbeat(beat(iid, stage), stage, iid)
    # Under `up` each instance has its own user: decode-1's user naming its connection decode-0 is ignored.
    assert instance_departed(reg, Departure("decode-0", "decode-1", "")) is None
    # A prefill role user (Helm) cannot make a decode instance leave; nor can the balancer or a monitor.
    for user in ("prefill", "balancer", "monitor"):
        assert instance_departed(reg, Departure("decode-0", user, "")) is None
    assert instance_departed(reg, Departure("nobody", "nobody", "")) is None
    assert left == []
    # Its own user (up), or its stage's (Helm, compose): it leaves at once, once.
    assert instance_departed(reg, Departure("decode-0", "decode-0", "Client Closed")).instance_id == "decode-0"
    assert instance_departed(reg, Departure("decode-abc", "decode", "")).instance_id == "decode-abc"
    assert instance_departed(reg, Departure("decode-0", "decode-0", "")) is None
    assert left == [("decode-0", "disconnected"), ("decode-abc", "disconnected")]
    assert sorted(i.instance_id for i in reg.live("decode")) == ["decode-1"]
