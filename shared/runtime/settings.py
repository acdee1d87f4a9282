"""One settings object for every service: defaults here, overridden by an
optional YAML file, overridden by environment variables.

    INFERMESH_CONFIG=mesh.yaml            # the YAML file (sections as below)
    INFERMESH_<SECTION>__<FIELD>=value    # e.g. INFERMESH_ENGINE__MODEL=/models/llama

`infermesh config` prints every setting with its current value and its doc.
Env vars are read in this module only; services receive a Settings value.
"""

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "INFERMESH_"


@dataclass(slots=True)
class NatsSettings:
    url: str = "nats://127.0.0.1:4222"
    """Address of the NATS server (comma-separated for a cluster)."""
    connect_timeout_s: float = 5.0
    """Give up the first connection after this long."""
    request_timeout_s: float = 5.0
    """How long a dispatch waits for an instance's Ack."""


@dataclass(slots=True)
class TelemetrySettings:
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector; also read from OTEL_EXPORTER_OTLP_ENDPOINT. None writes spans to trace_dir."""
    trace_dir: str = ".infermesh/traces"
    """Folder of JSON-lines span files (one per process) when no OTLP endpoint is set."""
    log_level: str = "INFO"


@dataclass(slots=True)
class EngineSettings:
    model: str = "models/default"
    """Folder of a Hugging Face format checkpoint."""
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    """None sizes the pool from kv_cache_memory_bytes."""
    kv_cache_memory_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_model_len: int | None = None


@dataclass(slots=True)
class WorkerSettings:
    instance_id: str | None = None
    """Name on the mesh; None derives <stage>-<host>-<pid>."""
    heartbeat_interval_s: float = 1.0
    metrics_port: int = 0
    """Port of the Prometheus /metrics endpoint; 0 picks a free one."""
    grpc_port: int = 0
    """Port of the gRPC server (health, admin); 0 picks a free one."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""


@dataclass(slots=True)
class KVCacheSettings:
    address: str = "127.0.0.1:50051"
    """Where workers reach the kvcache service."""
    path: str = ".infermesh/kvcache"
    """LMDB folder of the block store."""
    capacity_bytes: int = 4 << 30
    """Evict least recently used blocks beyond this."""
    ttl_s: float = 7 * 24 * 3600.0
    """Blocks unused for this long expire."""
    chunk_bytes: int = 1 << 20
    """Size of the data chunks of a streamed block."""


@dataclass(slots=True)
class BalancerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, requests must bring `Authorization: Bearer <api_key>`."""
    model_name: str | None = None
    """The name /v1/models reports; None takes the model folder's name."""
    heartbeat_misses: int = 3
    """An instance missing this many heartbeats is dropped from the registry."""
    max_queued_requests: int = 256
    """Requests in flight beyond this are refused with 429."""
    max_request_bytes: int = 4 << 20
    """Bodies larger than this are refused with 413."""
    first_token_timeout_s: float = 60.0
    """A request with no token from decode after this long fails (and is cancelled)."""
    token_timeout_s: float = 30.0
    """Longest silence between two chunks of a stream."""
    migration_limit: int = 1
    """How many times a request whose instance fails mid-way is moved to other
    instances (prompt + tokens so far) before the client gets an error."""


@dataclass(slots=True)
class Settings:
    nats: NatsSettings = field(default_factory=NatsSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    kvcache: KVCacheSettings = field(default_factory=KVCacheSettings)
    balancer: BalancerSettings = field(default_factory=BalancerSettings)


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
    return settings


def describe(settings: Settings) -> str:
    """Every setting, its env var, its value and its doc (for `infermesh config`)."""
    import inspect
    import re

    lines = []
    for section in dataclasses.fields(settings):
        obj = getattr(settings, section.name)
        source = inspect.getsource(type(obj))
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(obj):
            doc = re.search(rf'^\s+{f.name}:[^\n]*\n\s+"""(.*?)"""', source, re.S | re.M)
            env_name = f"{ENV_PREFIX}{section.name.upper()}__{f.name.upper()}"
            lines.append(f"  {f.name} = {getattr(obj, f.name)!r}    ({env_name})")
            if doc:
                lines.append(f"      {' '.join(doc.group(1).split())}")
    return "\n".join(lines)
