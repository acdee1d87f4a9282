"""One settings object for every service: defaults here, overridden by an
optional YAML file, overridden by environment variables.

    INFERMESH_CONFIG=mesh.yaml            # the YAML file (sections as below)
    INFERMESH_<SECTION>__<FIELD>=value    # e.g. INFERMESH_ENGINE__MODEL=/models/llama

`infermesh config` prints every setting with its current value and its doc
(the docstring under each field). The `engine` section is EngineConfig itself
(shared/engine/config.py, torch-free), so a field added there is a setting,
with its env var and doc, with no change here.
Env vars are read in this module only; services receive a Settings value.
"""

import ast
import dataclasses
import inspect
import ipaddress
import os
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shared.engine.config import EngineConfig
from shared.kv.wire.nixl_plane import DEFAULT_NIXL_BYTES, DEFAULT_STAGING_BYTES
from shared.kv.wire.shm import DEFAULT_SHM_BYTES

ENV_PREFIX = "INFERMESH_"


@dataclass(slots=True)
class NatsSettings:
    url: str = "nats://127.0.0.1:4222"
    """Address of the NATS server (comma-separated for a cluster)."""
    connect_timeout_s: float = 5.0
    """Give up the first connection after this long."""
    request_timeout_s: float = 5.0
    """How long a dispatch waits for an instance's Ack."""
    user: str | None = None
    """User name this service logs in to NATS with (its role's or its instance's
    account, which carries its subject permissions); None connects without one."""
    password: str | None = None
    """Password of nats.user (`infermesh up` generates one per user; compose takes
    it from its env file). Read at connect; nats.password_file instead keeps it
    out of the environment."""
    password_file: str | None = None
    """A file holding nats.password (a mounted Secret: Helm gives each pod its own
    instance's); read when connecting, trailing whitespace dropped. Ignored when
    nats.password is set."""
    tls_ca: str | None = None
    """PEM certificate of the CA that signed the NATS server's certificate. Set: the
    connection runs over TLS and the server must present a certificate of that CA
    for the host name in nats.url; None: plaintext (`infermesh up` on loopback)."""
    tls_cert: str | None = None
    """PEM client certificate presented to a NATS server that asks for one (with
    nats.tls_key; optional: the password is what logs a service in)."""
    tls_key: str | None = None
    """PEM private key of nats.tls_cert."""


@dataclass(slots=True)
class TelemetrySettings:
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector; also read from OTEL_EXPORTER_OTLP_ENDPOINT. None writes spans to trace_dir."""
    trace_dir: str = ".infermesh/traces"
    """Folder of JSON-lines span files (one per process) when no OTLP endpoint is set."""
    log_level: str = "INFO"


@dataclass(slots=True)
class WorkerSettings:
    instance_id: str | None = None
    """Name on the mesh; None derives <stage>-<host>-<pid>."""
    heartbeat_interval_s: float = 0.5
    """How often a worker says it is alive (with its load); the balancer drops one
    silent for balancer.heartbeat_misses intervals (a frozen process: 1.5 s). A
    worker that dies is noticed sooner, when NATS closes its connection."""
    kv_snapshot_interval_s: float = 10.0
    """How often a worker publishes all its prefix cache holds, beside the changes it
    publishes as they happen: a balancer restarted, or one that missed an event,
    routes by the cache again within this (shared/kv/events.py)."""
    metrics_port: int = 0
    """Port of the Prometheus /metrics endpoint; 0 picks a free one."""
    grpc_port: int = 0
    """Port of the gRPC server (health, admin); 0 picks a free one."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    kv_flush_timeout_s: float = 10.0
    """On SIGTERM, after the drain: how long a worker waits for the KV it writes behind
    to kvcache to be stored (its flush); the blocks still on their way then are
    counted (kv_flush_blocks_lost_total) and lost to the cache. Grace periods
    (compose's stop_grace_period, Helm's terminationGracePeriodSeconds, `infermesh
    up`'s stop) leave room for drain_timeout_s plus this."""
    bind_host: str = "127.0.0.1"
    """Interface the gRPC server (kvcache, workers) and /metrics listen on:
    loopback unless told otherwise; containers and pods set 0.0.0.0."""
    grpc_token: str | None = None
    """This service's own gRPC token (one per identity: prefill, decode, vision,
    balancer): its calls carry `authorization: Bearer <grpc_token>`, and the servers
    it calls know who it is by the token's hash (their grpc_peers). None: its calls
    carry nothing."""
    grpc_peers: str | None = None
    """Who may call this service's gRPC server: `identity:sha256-of-its-token` pairs,
    comma-separated (not secret: hashes of random tokens; `infermesh up`, compose's
    secrets.env and Helm's auth Secret make them). Calls (but grpc.health.v1) with
    another token are refused UNAUTHENTICATED, and kvcache refuses an identity a
    method is not for with PERMISSION_DENIED (only prefill and decode store blocks).
    None checks nothing, which only a server bound to loopback may do: bound beyond
    it, the service refuses to start."""
    tls_cert: str | None = None
    """PEM certificate (chain) this process presents on the mesh's gRPC plane, as
    server and as client. With tls_key and tls_ca set too, gRPC runs over mutual
    TLS: servers refuse a client without a certificate signed by tls_ca (Helm makes
    the CA and one certificate per service); None with the others: plaintext."""
    tls_key: str | None = None
    """PEM private key of worker.tls_cert."""
    tls_ca: str | None = None
    """PEM certificate of the CA that signed every certificate of the mesh: clients
    check servers against it, servers check clients."""

    def __post_init__(self) -> None:
        if self.kv_flush_timeout_s < 0:
            raise ValueError(f"worker.kv_flush_timeout_s must be 0 or more, got {self.kv_flush_timeout_s}")

    @property
    def binds_loopback(self) -> bool:
        """Whether bind_host is the loopback interface (then so is everything the process
        opens: NIXL's UCX listens on loopback alone)."""
        return is_loopback(self.bind_host)


def is_loopback(host: str) -> bool:
    """Whether host names the loopback interface (a name other than localhost is not:
    it may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True)
class KVCacheSettings:
    address: str = "127.0.0.1:50051"
    """Where workers reach the kvcache service."""
    path: str = ".infermesh/kvcache"
    """LMDB folder of the block store."""
    capacity_bytes: int = 4 << 30
    """Evict least recently used blocks beyond this."""
    ttl_s: float = 7 * 24 * 3600.0
    """Blocks unused for this long expire (and the longest ttl a blob may ask for)."""
    blob_capacity_bytes: int = 1 << 30
    """Keyed blobs (the vision stage's image embeddings, PutBlobs) beyond this many data
    bytes are evicted, those due to expire soonest first; counted apart from the blocks'
    capacity_bytes, so that embeddings and KV do not evict each other."""
    chunk_bytes: int = 8 << 20
    """Size of the data chunks of a streamed block (at most gRPC's message limit less framing)."""
    shm_bytes: int = DEFAULT_SHM_BYTES
    """Size of each kvcache client's shared-memory segment (made at its first Get or
    Put, reused, memory taken as used): on the service's host (same PID namespace, as
    under `infermesh up`) Get and Put move block data through it and gRPC carries only
    headers. Separate containers cannot share it: the service refuses it and the
    data goes over the gRPC stream. 0 always uses the stream."""
    nixl_staging_bytes: int = DEFAULT_STAGING_BYTES
    """The service's host memory registered with NIXL (kv_transfer.nixl): blocks of a Get
    through NIXL are read into it and written from it into the client's landing buffer;
    4 Gets at once, a quarter each (a larger client buffer lands at most a quarter per Get)."""
    lookup_timeout_s: float = 1.0
    """A worker's lookup that kvcache does not answer within this counts as a miss
    (the request computes instead of waiting for the cache); a health probe
    unanswered within it marks kvcache down."""
    probe_interval_s: float = 0.5
    """How often workers and the balancer check kvcache's health; once it is back
    a worker redials at once (no gRPC reconnect backoff) and uses it again."""
    load_when_faster: bool = True
    """Load a prefix hit from kvcache only when the load, at the bandwidth this
    worker's loads achieve, is not much slower than recomputing it at the engine's
    prefill rate (on a GPU a big model recomputes ~10x faster than kvcache serves);
    false loads every hit."""


@dataclass(slots=True)
class KVTransferSettings:
    peer_copy: bool = True
    """Copy a peer's held KV by mapping its cache into this process (shared memory on
    the CPU, CUDA IPC on a GPU): the fastest path, where both share a host and a PID
    namespace (`infermesh up`). Off, such peers use NIXL too (benchmarks compare them)."""
    nixl: bool = True
    """Move KV between engines, and from kvcache, through NIXL (UCX underneath:
    shared memory or CUDA IPC within a node, RDMA or TCP between nodes) wherever
    the same-namespace copy cannot reach: another container, pod or node. Off, or
    without the nixl package, those fall back to kvcache's gRPC byte stream. UCX
    reads its own environment: UCX_TLS picks the transports (tcp where there is no
    RDMA), UCX_NET_DEVICES the network devices."""
    nixl_backends: str = "UCX"
    """NIXL backends to instantiate, comma separated (UCX moves bytes on every fabric here)."""
    nixl_metadata_timeout_s: float = 2.0
    """How long a worker waits for a peer's NIXL agent metadata over NATS before it
    reads the KV from kvcache instead (a peer that is gone answers at once: no responders)."""
    nixl_transfer_timeout_s: float = 30.0
    """A NIXL transfer not done within this is abandoned: its tokens are recomputed (a
    read from a peer), or the rest of a kvcache Get goes over the gRPC stream (a write by
    the kvcache service)."""
    kvcache_nixl_bytes: int = DEFAULT_NIXL_BYTES
    """With nixl on, each kvcache client's landing buffer (host memory registered with
    the worker's NIXL agent, made at its first Get, reused): where the kvcache service
    cannot open the client's shared-memory segment (another container, pod or node) it
    WRITEs the blocks of a Get into this buffer through NIXL instead of streaming
    them over gRPC. Puts keep to the stream."""

    @property
    def backends(self) -> tuple[str, ...]:
        """nixl_backends as the agent takes them."""
        return tuple(b.strip() for b in self.nixl_backends.split(",") if b.strip())


@dataclass(slots=True)
class BalancerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, requests must bring `Authorization: Bearer <api_key>`."""
    model_name: str | None = None
    """The names requests may ask for, comma-separated (vLLM's --served-model-name;
    `infermesh up --served-model-name A B`): the first is the one responses and
    metrics carry and /v1/models lists first. None takes the model folder's name.
    Requests may leave model out (one model is served)."""
    prefix_cache_reset: bool = False
    """Answer POST /reset_prefix_cache (every prefill and decode instance forgets the KV
    it keeps for reuse; `infermesh profile`'s kvcache round needs it). Off by default:
    any holder of the API key could make every later request recompute its prefix, so
    it is an operator's switch, as vLLM serves the endpoint only in its dev mode; off,
    the endpoint answers 403 naming this setting."""
    heartbeat_misses: int = 3
    """An instance missing this many heartbeats is dropped from the registry."""
    max_heartbeat_interval_s: float = 5.0
    """A heartbeat claiming a longer interval is refused (and counted): a claim
    decides how long a silent instance still gets work."""
    max_queued_requests: int = 256
    """Requests in flight beyond this are refused with 429."""
    max_dispatched_requests: int = 0
    """At most this many generations dispatched to the mesh at once; the rest wait
    in the balancer, lower `priority` first, then by arrival (0: dispatch at once,
    and a request's priority must be 0)."""
    max_request_bytes: int = 50 << 20
    """Bodies larger than this are refused with 413. Images sent inline (base64 data:
    URLs, 4/3 of their bytes) count against it, so it bounds a request's inline images
    together, as OpenAI's 50 MB payload limit does: the default admits one image of
    images.max_bytes (20 MiB, ~27 MiB as base64) beside the conversation, or about
    37 MiB of images in all. images.max_per_request x images.max_bytes is the bound
    only for http(s) URLs, which the balancer downloads."""
    first_token_timeout_s: float = 60.0
    """A request with no token from decode after this long fails (and is cancelled)."""
    token_timeout_s: float = 30.0
    """Longest silence between two chunks of a stream."""
    migration_limit: int = 1
    """How many times a request whose instance fails mid-way is moved to other
    instances (prompt + tokens so far) before the client gets an error. Moves off
    instances that died without a fair chance at the request (a node's death) are
    not counted, up to a bound (services/balancer/router/move_budget.py)."""
    local_prefill_max_tokens: int = 0
    """Conditional disaggregation (Dynamo's max_local_prefill_length): a prompt with
    at most this many tokens left to compute (beyond the longest prefix a prefill
    instance or the decode instance holds) is prefilled by its decode instance,
    which then decodes it: moving its KV would cost more than computing it there.
    With this or local_prefill_queue_tokens on, the decode instance is chosen by
    its cache as well as its load (services/balancer/router/policies.py). 0: never for length."""
    local_prefill_queue_tokens: int = 0
    """Conditional disaggregation by load: when the least loaded prefill instance
    has at least this many prompt tokens queued, the decode instance prefills the
    request itself (its decode tokens ride in the same steps). 0: never for load.
    Worth it where prefill and decode share a GPU, which time-slices them. With
    either setting on, a request also prefills on decode when no prefill
    instance is live, rather than failing."""
    kv_overlap_weight: float = 1.0
    """Cache-aware routing's weight (Dynamo's --kv-overlap-score-weight): an instance
    costs this x the prompt's KV blocks it would compute, plus the blocks queued on it;
    the least cost is chosen (prefill always, decode under conditional disaggregation).
    1: a block held saves as much as a block of queue; 0: caches ignored (load only);
    higher: more traffic to the holders of a prefix, at the price of their queues."""
    tool_call_parser: str = "auto"
    """How chat replies are read for tool calls under tool_choice auto (vLLM's
    --tool-call-parser): hermes (<tool_call> JSON, Qwen/Hermes), llama3_json (Llama
    3.x's JSON), or auto: the one the chat template asks for (hermes for templates
    that take no tools: the balancer then writes the tools into the prompt itself)."""
    reasoning_parser: str = "auto"
    """How chat replies are split into reasoning_content and content (vLLM's
    --reasoning-parser): qwen3 and deepseek_v3/deepseek_v4 (<think>...</think>),
    deepseek_r1 (the same, the reply starting inside the block), openai_gptoss
    (harmony's analysis channel), none (replies left whole), or auto: the one the
    chat template writes (none for templates without reasoning)."""
    responses_bucket: str = "im_responses"
    """The NATS JetStream key-value bucket where /v1/responses keeps stored responses
    (store: true, OpenAI's default) for previous_response_id and GET/DELETE by id;
    every balancer of a mesh must name the same one. The NATS users of `up`, compose
    and Helm grant the balancer this default name only (tools/launch/nats_auth.py
    RESPONSES_BUCKET): another name needs the same grants for it."""
    responses_ttl_s: float = 30 * 24 * 3600.0
    """How long a stored response is kept (the bucket's max_age; OpenAI keeps them 30
    days). The bucket's creator sets it: a bucket that already exists keeps its own."""

    def __post_init__(self) -> None:
        if not (0 <= self.kv_overlap_weight < float("inf")):
            raise ValueError(f"balancer.kv_overlap_weight must be a finite number >= 0, got {self.kv_overlap_weight}")
        if not self.responses_ttl_s > 0:
            raise ValueError(f"balancer.responses_ttl_s must be positive, got {self.responses_ttl_s}")
        if not self.responses_bucket or not all(c.isascii() and (c.isalnum() or c in "_-")
                                                for c in self.responses_bucket):
            raise ValueError("balancer.responses_bucket must be letters, digits, _ and - (a JetStream bucket "
                             f"name), got {self.responses_bucket!r}")


@dataclass(slots=True)
class ImageSettings:
    """Images of chat requests (image_url content parts): what the balancer loads
    before it dispatches a request (shared/multimodal/)."""

    max_per_request: int = 8
    """A request with more image parts than this is refused with a 400 before any is loaded."""
    max_bytes: int = 20 << 20
    """An image's encoded bytes, downloaded or decoded from a data: URL, at most this
    many (a download is cut off as soon as it passes them); OpenAI's per-image limit.
    A data: URL also counts, as base64, against balancer.max_request_bytes (the whole
    body's limit, which bounds a request's inline images together): keep that above
    4/3 of this, or an image this allows cannot be sent inline."""
    max_pixels: int = 1 << 24
    """An image of more pixels (width x height) than this is refused before its pixel
    data is decoded: a small file can declare a huge image (a decompression bomb).
    2**24 is 4096 x 4096, 48 MiB as RGB."""
    fetch_timeout_s: float = 10.0
    """An http(s) image not fully downloaded within this (redirects included) is refused."""
    max_redirects: int = 3
    """Redirects followed per image; each hop's address is checked as the first one's. 0 follows none."""
    fetch_private: bool = False
    """Fetch image URLs whose host resolves to a private, loopback, link-local or
    otherwise non-public address. Off, such a URL (or a redirect to one) is refused:
    the balancer sits inside the mesh's network and must not be a client's way into
    it. On only where the images are served inside that network (tests, a local store)."""


@dataclass(slots=True)
class VisionSettings:
    """The vision stage (services/vision, E/P/D): vision instances run the model's image
    processor and tower, keep the embeddings by image identity and store them in kvcache,
    which prefill and decode read. Without a live vision instance the mesh encodes on
    prefill (E/PD), as it does with `enabled` off."""

    enabled: bool = True
    """The balancer sends a request's images to a vision instance when one is live; off:
    always encoded on prefill (E/PD). `infermesh up --vision N` starts N instances."""
    encode_timeout_s: float = 30.0
    """How long the balancer waits for a vision instance to encode a request's images
    before it asks another one (or, with none left, lets prefill encode them)."""
    max_batch_images: int = 16
    """At most this many images (of any requests) through the tower in one batch."""
    batch_wait_s: float = 0.005
    """How long a batch waits for more images after its first: images of concurrent
    requests share a tower forward."""
    cache_device_bytes: int = 256 << 20
    """Embeddings kept on the instance's device, least recently used beyond this moved
    to host memory."""
    cache_host_bytes: int = 1 << 30
    """Embeddings kept in host memory; least recently used beyond this are dropped (kvcache
    still holds them for embedding_ttl_s)."""
    embedding_ttl_s: float = 24 * 3600.0
    """How long kvcache keeps an image's embeddings after their last use (at most kvcache.ttl_s)."""
    fetch_timeout_s: float = 5.0
    """Prefill and decode give up fetching embeddings from kvcache after this and encode
    the images themselves."""
    heartbeat_hashes: int = 1024
    """At most this many image identities (the most recently used) in a vision
    instance's heartbeat: the balancer's cache affinity."""
    prefill_max_image_tokens: int = 0
    """The crossover of the vision policy (encode_on_prefill): a request whose one image
    takes at most this many tokens (merged patches), and that no vision instance holds,
    is encoded on prefill, saving the round trip to a vision instance and the fetch of
    its embeddings. 0 (the default): every image goes to the vision stage. Where the
    crossover lies depends on the tower, the device and the network: measure it
    (tools/bench/vision_bench.py) before setting it."""
    share_bytes: int = 64 << 20
    """Shared memory a vision instance writes embeddings into for prefill and decode on
    its host to copy straight out (shared/stage/embedding_share.py), a ring: the oldest
    are overwritten (kvcache still holds them). 0: kvcache is the only path."""
    nixl: bool = False
    """Also offer that ring through NIXL (shared/stage/embedding_nixl.py): prefill and
    decode that cannot map it (another container, pod or node) READ an image's entry
    through their NIXL agent instead of fetching it from kvcache. Needs kv_transfer.nixl
    (its backends; off there, off here) on this instance and the readers, and UCX
    reaching this instance from theirs: off by default; the chart's stages.vision.nixl
    sets it and opens UCX between vision and prefill and decode pods (docs/deploy.md)."""
    reuse_embeddings: bool = True
    """A vision instance looks an image up in its memory and in kvcache before encoding
    it; off: it encodes every image it is sent (the no-cache baseline of
    tools/bench/vision_bench.py), storing the embeddings for prefill and decode as ever."""


@dataclass(slots=True)
class PlannerSettings:
    """The live planner (services/planner): every interval it reads the balancer's
    /metrics, forecasts the next interval's load, corrects the profile by measured
    over predicted latency, and sets each stage's replicas (Dynamo's SLA planner)."""

    profile: str = ""
    """The stage profile `infermesh profile` wrote (JSON); the planner refuses to start without one."""
    interval_s: float = 60.0
    """How often it plans (and how long a window of load each decision is based on)."""
    startup_s: float = 60.0
    """How long a new instance takes to serve (start, load, warm up): the planner sizes
    for the most load it forecasts that far ahead."""
    metrics_url: str = ""
    """The balancer's Prometheus /metrics; "": http://<balancer.host>:<balancer.port>/metrics."""
    ttft_ms: float = 1000.0
    """The time-to-first-token target at `percentile`."""
    itl_ms: float = 100.0
    """The inter-token latency target at `percentile`."""
    percentile: float = 90.0
    backend: str = "advisory"
    """Where decisions go: advisory (published as metrics and logs, nothing changed), up
    (`infermesh up`'s replicas file) or kubernetes (each stage's StatefulSet scale)."""
    replicas_file: str = ""
    """The up backend's file (<state_dir>/replicas.json)."""
    statefulsets: str = ""
    """The kubernetes backend's targets, stage=name pairs: prefill=im-prefill,decode=im-decode."""
    namespace: str = ""
    """The kubernetes backend's namespace; "": the pod's own."""
    headroom: float = 1.0
    """Size for this many times the forecast request rate: capacity for bursts no forecast sees
    within an instance's start (1.5 met every interval of the simulator's bursty day at 0.80x
    the best fixed allocation's GPU-hours; 1.0 met 95.8 % at 0.56x: docs/planner.md)."""
    gpu_budget: int = 0
    """At most this many devices over every stage (0: no limit); a plan over it is cut, said in the log."""
    min_replicas: int = 1
    """No stage scaled below this (prefill and decode; vision may go to 0 when the load has no images)."""
    max_replicas: int = 16
    """No stage scaled above this."""
    gpu_hour_usd: float = 2.0
    """A device-hour's price, for the cost per million tokens the planner publishes."""


@dataclass(slots=True)
class Settings:
    nats: NatsSettings = field(default_factory=NatsSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    kvcache: KVCacheSettings = field(default_factory=KVCacheSettings)
    kv_transfer: KVTransferSettings = field(default_factory=KVTransferSettings)
    balancer: BalancerSettings = field(default_factory=BalancerSettings)
    images: ImageSettings = field(default_factory=ImageSettings)
    vision: VisionSettings = field(default_factory=VisionSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Turn a YAML or env value into the field's type; a clear error if it cannot."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _coerce(value, args[0], where)
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if annotation in (int, float, str):
            return annotation(value)
    except (TypeError, ValueError):
        raise ValueError(f"setting {where}: cannot read {value!r} as {annotation.__name__}") from None
    raise TypeError(f"setting {where}: unsupported type {annotation}")


def _apply(section: Any, values: Mapping[str, Any], section_name: str) -> None:
    hints = typing.get_type_hints(type(section))
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(hints)
            raise ValueError(f"unknown setting {section_name}.{key} (known: {known})")
        setattr(section, key, _coerce(value, hints[key], f"{section_name}.{key}"))


def load_settings(
    yaml_path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    env = os.environ if env is None else env
    settings = Settings()
    yaml_path = yaml_path or env.get(f"{ENV_PREFIX}CONFIG")
    sections = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    if yaml_path:
        data = yaml.safe_load(Path(yaml_path).read_text()) or {}
        for name, values in data.items():
            if name not in sections or not isinstance(values, dict):
                raise ValueError(f"{yaml_path}: unknown section {name!r} (known: {', '.join(sections)})")
            _apply(sections[name], values, name)
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        settings.telemetry.otlp_endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        name, _, field_name = key[len(ENV_PREFIX) :].lower().partition("__")
        if name not in sections:
            raise ValueError(f"{key}: unknown section {name!r} (known: {', '.join(sections)})")
        _apply(sections[name], {field_name: value}, name)
    for name, section in sections.items():
        # A new instance runs the section's own checks (EngineConfig.__post_init__)
        # on the values set above: a bad dtype stops the service at start, with its name.
        setattr(settings, name, dataclasses.replace(section))
    return settings


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read off its source, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def env_name(section: str, field_name: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}__{field_name.upper()}"


# Fields whose values `infermesh config` never prints (they end up in logs and terminals).
SECRET_FIELDS = frozenset({"password", "grpc_token", "api_key"})


def describe(settings: Settings) -> str:
    """Every setting, its env var, its value and its doc (for `infermesh config`)."""
    lines = []
    for section in dataclasses.fields(settings):
        obj = getattr(settings, section.name)
        docs = field_docs(type(obj))
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            shown = "'<secret>'" if value is not None and f.name in SECRET_FIELDS else repr(value)
            lines.append(f"  {f.name} = {shown}    ({env_name(section.name, f.name)})")
            if f.name in docs:
                lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)
