"""NATS subject names, defined once (see proto/infermesh/mesh.proto). Every
subject is built here, so NATS permissions can be generated from these helpers.

A token stream's subject names the instance that publishes it,
`im.stream.<instance_id>.<request_id>`: with permissions that let instance X
publish only on `im.stream.X.>` (stream_of_instance), the subject proves who sent
a chunk, and the balancer listens only to the instance it handed the request to.
Heartbeats and a worker's KV events name their instance the same way
(`im.heartbeat.<stage>.<instance>`, `im.kv.events.<instance>`): the balancer
takes a message only when its body names the instance of its subject.
"""

PREFIX = "im"
CANCEL = f"{PREFIX}.cancel"
KV_EVENTS = f"{PREFIX}.kv.events"
"""The kvcache service's own block events (workers publish on kv_events(instance))."""
KV_EVENTS_ALL = f"{PREFIX}.kv.events.*"
"""Every worker's KV events."""
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*.*"
CLIENT_DISCONNECTED = f"{PREFIX}.nats.disconnected"
"""Where nats-server's advisory of a client that left (its connection closed: the
process died, or drained) arrives in the mesh's account; only the server feeds it
(see tools/launch/nats_auth.py). The balancer moves that instance's requests at once."""
STREAM_OLD_FORM = f"{PREFIX}.stream.*"
"""The old one-token stream subject (`im.stream.<request_id>`): nobody publishes
there any more; the balancer counts what arrives as forged."""


def prefill_run(instance_id: str) -> str:
    return f"{PREFIX}.prefill.{instance_id}.run"


def decode_admit(instance_id: str) -> str:
    return f"{PREFIX}.decode.{instance_id}.admit"


def decode_run(instance_id: str) -> str:
    """Where the balancer sends a decode instance a whole request (PrefillRequest) to
    prefill as well as decode: conditional disaggregation."""
    return f"{PREFIX}.decode.{instance_id}.run"


def vision_encode(instance_id: str) -> str:
    """Where the balancer asks a vision instance to encode a request's images (EncodeRequest)."""
    return f"{PREFIX}.vision.{instance_id}.encode"


def reset_prefix_cache(stage: str, instance_id: str) -> str:
    """Where the balancer asks a prefill or decode instance to forget the blocks it keeps
    for reuse (ResetPrefixCache; the profile's kvcache round, POST /reset_prefix_cache)."""
    return f"{PREFIX}.{check_token(stage)}.{check_token(instance_id)}.reset_prefix_cache"


def kv_release(instance_id: str) -> str:
    """Where a decode instance tells the prefill instance it copied a request's KV from
    that the blocks may go (KvRelease)."""
    return f"{PREFIX}.kv.release.{check_token(instance_id)}"


def kv_nixl(instance_id: str) -> str:
    """Where an instance that holds KV for peers answers a NixlMetadataRequest with its
    NIXL agent's metadata (a reader asks once per peer, then reads through NIXL)."""
    return f"{PREFIX}.kv.nixl.{check_token(instance_id)}"


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


def heartbeat(stage: str, instance_id: str) -> str:
    """Where instance_id (of stage) publishes its heartbeats."""
    return f"{PREFIX}.heartbeat.{check_token(stage)}.{check_token(instance_id)}"


def heartbeats_of(stage: str) -> str:
    """Every instance's heartbeats of one stage (a subscription)."""
    return f"{PREFIX}.heartbeat.{check_token(stage)}.*"


def kv_events(instance_id: str) -> str:
    """Where instance_id publishes the blocks that entered or left its memory."""
    return f"{PREFIX}.kv.events.{check_token(instance_id)}"


def last_token(subject: str) -> str:
    """The instance a heartbeat or KV event subject names (its last token)."""
    return subject.rsplit(".", 1)[-1]


def check_token(name: str) -> str:
    """Instance and request ids become subject tokens: no dots, spaces or wildcards."""
    if not name or any(c in name for c in ".*> \t\r\n"):
        raise ValueError(f"{name!r} cannot be part of a NATS subject")
    return name


RESPONSES_BUCKET = "im_responses"
"""The JetStream key-value bucket of /v1/responses' stored responses
(BalancerSettings.responses_bucket's default; the NATS users grant this one)."""


def kv_bucket_subjects(bucket: str) -> tuple[str, ...]:
    """What a client of one JetStream key-value bucket publishes (nats-py's
    create_key_value, key_value, get, put, delete): the bucket's own subjects, and the
    JetStream API calls on its stream only. Their replies come to the client's inbox."""
    stream = f"KV_{bucket}"
    return (
        f"$KV.{bucket}.>",
        f"$JS.API.STREAM.CREATE.{stream}",
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    )
