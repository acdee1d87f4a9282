"""The one tracing setup: an OpenTelemetry TracerProvider per process, spans
exported over OTLP/gRPC when an endpoint is set, else appended as JSON lines to
a file of this process under trace_dir (read by `infermesh trace`). W3C
traceparent travels in NATS headers (helpers here) and gRPC metadata (the
OpenTelemetry gRPC interceptors, see rpc.py)."""

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from shared.runtime.settings import TelemetrySettings


class JsonLinesSpanExporter(SpanExporter):
    """One JSON object per finished span, appended to a file owned by this process
    (one file per process, so concurrent services never interleave lines)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(s), separators=(",", ":")) for s in spans]
        with self._lock:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_to_dict(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name", "?"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: v if isinstance(v, (str, int, float, bool)) else list(v) for k, v in (span.attributes or {}).items()},
    }


def setup_telemetry(service_name: str, instance_id: str, settings: TelemetrySettings) -> TracerProvider:
    """Configure logging and tracing for this process; returns the provider
    (call shutdown() on exit to flush). Services pass tracers down explicitly
    via provider.get_tracer(); the global provider is set too, for the gRPC
    instrumentation which looks it up."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {instance_id} %(name)s: %(message)s",
    )
    resource = Resource.create({"service.name": service_name, "service.instance.id": instance_id})
    provider = TracerProvider(resource=resource)
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter: SpanExporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True)
    else:
        path = Path(settings.trace_dir) / f"{service_name}-{instance_id}-{os.getpid()}.jsonl"
        exporter = JsonLinesSpanExporter(path)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    return provider


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """The current trace context as NATS headers (traceparent, tracestate)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> context.Context:
    """The trace context carried by a NATS message's headers."""
    return propagate.extract(dict(headers or {}))
