"""NATS subject names, defined once (see proto/infermesh/mesh.proto). Every
subject is built here, so NATS permissions can be generated from these helpers.

A token stream's subject names the instance that publishes it,
`im.stream.<instance_id>.<request_id>`: with permissions that let instance X
publish only on `im.stream.X.>` (stream_of_instance), the subject proves who sent
a chunk, and the balancer listens only to the instance it handed the request to.
"""

PREFIX = "im"
CANCEL = f"{PREFIX}.cancel"
KV_EVENTS = f"{PREFIX}.kv.events"
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"
STREAM_OLD_FORM = f"{PREFIX}.stream.*"
"""The old one-token stream subject (`im.stream.<request_id>`): nobody publishes
there any more; the balancer counts what arrives as forged."""


def prefill_run(instance_id: str) -> str:
    return f"{PREFIX}.prefill.{instance_id}.run"


def decode_admit(instance_id: str) -> str:
    return f"{PREFIX}.decode.{instance_id}.admit"


def kv_release(instance_id: str) -> str:
    """Where a decode instance tells the prefill instance it copied a request's KV from
    that the blocks may go (KvRelease)."""
    return f"{PREFIX}.kv.release.{check_token(instance_id)}"


def stream(instance_id: str, request_id: str) -> str:
    """Where instance_id publishes the token stream (or the error) of request_id."""
    return f"{PREFIX}.stream.{check_token(instance_id)}.{check_token(request_id)}"


def stream_of_instance(instance_id: str) -> str:
    """Every stream instance_id may publish (the wildcard its permissions allow)."""
    return f"{PREFIX}.stream.{check_token(instance_id)}.>"


def stream_instance(subject: str) -> str | None:
    """The publishing instance named by a stream subject; None for another subject."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != PREFIX or parts[1] != "stream":
        return None
    return parts[2]


def heartbeat(stage: str) -> str:
    return f"{PREFIX}.heartbeat.{stage}"


def check_token(name: str) -> str:
    """Instance and request ids become subject tokens: no dots, spaces or wildcards."""
    if not name or any(c in name for c in ".*> \t\r\n"):
        raise ValueError(f"{name!r} cannot be part of a NATS subject")
    return name
