"""`infermesh trace last | ID`: a request's span tree as a terminal waterfall,
read from the JSON-lines span files the services write (telemetry.py)."""

import json
import time
from collections import defaultdict
from pathlib import Path

# Attributes worth a place on the waterfall line, in this order.
_SHOWN = (
    "prompt.tokens", "prompt.cached_tokens", "output.tokens", "ttft_ms",
    "prefill.choice", "prefill.reason", "decode.choice", "kv.path",
    "kv.loaded_blocks", "kv.loaded_bytes", "kv.load_ms", "kv.stored_blocks", "kv.stored_bytes",
    "kvcache.blocks", "kvcache.hits", "kvcache.bytes", "finish_reason",
)


def load_spans(trace_dir: str | Path) -> list[dict]:
    spans = []
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    spans.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash: skip it
    return spans


def request_span(trace_dir: str | Path, request_id: str, name: str, timeout_s: float = 30.0) -> dict:
    """The attributes of the span `name` in a request's trace, once it has reached the
    trace files (spans are written when they end, in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = load_spans(trace_dir)
        root = next((s for s in spans if s["attributes"].get("request.id") == request_id and s["parent_id"] is None), None)
        if root is not None:
            found = [s for s in spans if s["trace_id"] == root["trace_id"] and s["name"] == name]
            if found:
                return found[0]["attributes"]
        if time.monotonic() > deadline:
            raise LookupError(f"no {name} span of {request_id} within {timeout_s} s in {trace_dir}")
        time.sleep(0.2)


def pick_trace(spans: list[dict], which: str) -> list[dict]:
    """`last`: the request whose trace started last (health checks and other traces
    without a request are passed over); else a request id, or a trace id (prefix ok)."""
    if which == "last":
        roots = [s for s in spans if s["parent_id"] is None and "request.id" in s["attributes"]]
        if not roots:
            raise LookupError("no request traced yet")
        trace_id = max(roots, key=lambda s: s["start_ns"])["trace_id"]
    elif by_request := {s["trace_id"] for s in spans if s["attributes"].get("request.id") == which}:
        if len(by_request) != 1:
            raise LookupError(f"{len(by_request)} traces carry request {which!r}")
        trace_id = by_request.pop()
    else:
        ids = {s["trace_id"] for s in spans if s["trace_id"].startswith(which)}
        if len(ids) != 1:
            raise LookupError(f"{len(ids)} traces match {which!r}")
        trace_id = ids.pop()
    return [s for s in spans if s["trace_id"] == trace_id]


def render_waterfall(spans: list[dict], width: int = 40) -> str:
    by_parent: dict[str | None, list[dict]] = defaultdict(list)
    ids = {s["span_id"] for s in spans}
    for s in spans:
        # A span whose parent is in another (unseen) file still shows, at the top.
        by_parent[s["parent_id"] if s["parent_id"] in ids else None].append(s)
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    total = max(t1 - t0, 1)
    lines = [f"trace {spans[0]['trace_id']}  {total / 1e6:.1f} ms  {len(spans)} spans"]

    def walk(span: dict, depth: int) -> None:
        start = (span["start_ns"] - t0) / total
        end = (span["end_ns"] - t0) / total
        a = int(start * width)
        b = max(a + 1, int(end * width))
        bar = " " * a + "█" * (b - a) + " " * (width - b)
        label = f"{'  ' * depth}{span['service']}: {span['name']}"
        attrs = span.get("attributes", {})
        shown = " ".join(f"{k}={attrs[k]}" for k in _SHOWN if k in attrs)
        err = " ERROR" if span.get("status") == "ERROR" else ""
        dur = (span["end_ns"] - span["start_ns"]) / 1e6
        lines.append(f"{label:<46.46} |{bar}| {dur:9.1f} ms{err} {shown}")
        for child in sorted(by_parent.get(span["span_id"], []), key=lambda s: s["start_ns"]):
            walk(child, depth + 1)

    for root in sorted(by_parent[None], key=lambda s: s["start_ns"]):
        walk(root, 0)
    return "\n".join(lines)
