"""NATS subject names, defined once (see proto/infermesh/mesh.proto)."""

PREFIX = "im"
CANCEL = f"{PREFIX}.cancel"
KV_EVENTS = f"{PREFIX}.kv.events"
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"


def prefill_run(instance_id: str) -> str:
    return f"{PREFIX}.prefill.{instance_id}.run"


def decode_admit(instance_id: str) -> str:
    return f"{PREFIX}.decode.{instance_id}.admit"


def kv_release(instance_id: str) -> str:
    """Where a decode instance tells the prefill instance it copied a request's KV from
    that the blocks may go (KvRelease)."""
    return f"{PREFIX}.kv.release.{check_token(instance_id)}"


def stream(request_id: str) -> str:
    return f"{PREFIX}.stream.{request_id}"


def heartbeat(stage: str) -> str:
    return f"{PREFIX}.heartbeat.{stage}"


def check_token(name: str) -> str:
    """Instance and request ids become subject tokens: no dots, spaces or wildcards."""
    if not name or any(c in name for c in ".*> \t\r\n"):
        raise ValueError(f"{name!r} cannot be part of a NATS subject")
    return name
