"""A vision instance's heartbeat, as the balancer's registry takes it (the vision
policy's tests: tests/unit/test_vision_stage.py, test_vision_refusal.py)."""

from services.balancer.router.registry import Registry
from shared.proto import mesh_pb2


def beat(reg: Registry, iid: str, hashes: list[bytes], running: int = 0, waiting: int = 0) -> None:
    """Instance ``iid`` holding the images ``hashes``, with that load, heard by ``reg``."""
    hb = mesh_pb2.Heartbeat(stage="vision", instance_id=iid, interval_s=0.5, image_hashes=hashes,
                            load=mesh_pb2.Load(num_running=running, num_waiting=waiting))  # fmt: skip
    assert reg.on_heartbeat(hb) is None
