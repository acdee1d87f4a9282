"""Where the mesh's time goes, read from the traces its services wrote during a
`bench-mesh` run: the TTFT cut into its hops, the prefill -> decode KV handoff's
effective bandwidth, and how many requests decode had in flight at once.

Per request (the spans that carry its `request.id`), on one host's clock:

    root start --route--> route end --to prefill--> prefill start --prefill-->
    prefill end --handoff--> decode start --first token out--> root start + ttft_ms

`prefill` is the prefill service's span: its engine queue, the forward pass and
the handoff's publish. A hop can be negative where two spans overlap: decode can
start before prefill's span has closed, prefill before route's. The KV load is not on this path: decode streams
the first token at once and loads the KV meanwhile; `kv.load_ms` (from asking
the connector to the blocks' arrival) over `kv.loaded_bytes` is its bandwidth, and
`kv.copy_ms` over the same bytes the bandwidth of a direct copy itself (load_ms
also waits for the copy thread and for decode's next step, where a request joins
the batch).
"""

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from tools.launch.trace_view import load_spans

SEGMENTS = ("route", "to_prefill", "prefill", "handoff", "first_token_out")


def _p50(values: list[float]) -> float:
    return float(np.percentile(values, 50)) if values else float("nan")


def _max_overlap(intervals: list[tuple[int, int]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def prefill_pace(prefills: list[tuple[int, int]], decodes: list[tuple[int, int]]) -> dict[str, float]:
    """How fast the prefill instance turns prompts out, and whether decode was stepping
    meanwhile (both processes share one card: without MPS its time is sliced between
    them). `alone`: prefill spans decode spans covered less than half of; `back_to_back`: the gaps
    between consecutive prefill ends where the later prompt was already queued (one
    prompt's compute each), split by whether decode spans covered most of the gap."""
    def decode_busy(a: int, b: int) -> bool:  # decode spans cover most of [a, b]
        covered, reach = 0, a
        for s, e in sorted(decodes):
            s, e = max(s, reach), min(e, b)
            if e > s:
                covered += e - s
                reach = e
        return covered > (b - a) / 2

    alone = [(e - s) / 1e6 for s, e in prefills if not decode_busy(s, e)]
    ordered = sorted(prefills, key=lambda p: p[1])
    idle_gaps: list[float] = []
    busy_gaps: list[float] = []
    for (_, prev_end), (start, end) in zip(ordered, ordered[1:]):
        if start < prev_end:  # queued behind the previous prompt: the gap is this prompt's compute
            (busy_gaps if decode_busy(prev_end, end) else idle_gaps).append((end - prev_end) / 1e6)
    return {
        "prefill_alone_ms_p50": _p50(alone),
        "prefill_back_to_back_decode_idle_ms_p50": _p50(idle_gaps),
        "prefill_back_to_back_decode_busy_ms_p50": _p50(busy_gaps),
        "prefill_back_to_back_decode_busy_n": len(busy_gaps),
    }


def breakdown(spans: list[dict], windows: list[tuple[int, int]]) -> dict[str, Any]:
    """The figures of the requests whose root span started inside one of `windows`
    (unix ns), i.e. those of one concurrency level's mesh runs."""
    by_request: dict[str, dict[str, dict]] = defaultdict(dict)
    for span in spans:
        rid = span["attributes"].get("request.id")
        if rid is not None:
            name = "root" if span["parent_id"] is None else span["name"]
            by_request[rid].setdefault(name, span)
    segments: dict[str, list[float]] = {s: [] for s in SEGMENTS}
    ttfts: list[float] = []
    per_request_gb_s: list[float] = []
    copy_gb_s: list[float] = []
    load_ms_values: list[float] = []
    bytes_total = ms_total = 0.0
    num_direct = num_loaded = num_local = 0
    decode_intervals: list[tuple[int, int]] = []
    prefill_intervals: list[tuple[int, int]] = []
    for parts in by_request.values():
        root = parts.get("root")
        if root is None or not any(a <= root["start_ns"] <= b for a, b in windows):
            continue
        route, prefill, decode = parts.get("route"), parts.get("prefill"), parts.get("decode")
        num_local += bool(route is not None and route["attributes"].get("prefill.local"))
        if prefill is not None:
            prefill_intervals.append((prefill["start_ns"], prefill["end_ns"]))
        if decode is not None:
            decode_intervals.append((decode["start_ns"], decode["end_ns"]))
            attrs = decode["attributes"]
            loaded, load_ms = attrs.get("kv.loaded_bytes", 0), attrs.get("kv.load_ms", 0.0)
            if loaded and load_ms > 0:
                num_loaded += 1
                num_direct += bool(attrs.get("kv.loaded_direct"))
                per_request_gb_s.append(loaded / (load_ms * 1e-3) / 1e9)
                if attrs.get("kv.copy_ms", 0.0) > 0:
                    copy_gb_s.append(loaded / (attrs["kv.copy_ms"] * 1e-3) / 1e9)
                load_ms_values.append(load_ms)
                bytes_total += loaded
                ms_total += load_ms
        ttft_ms = root["attributes"].get("ttft_ms")
        if None in (route, prefill, decode, ttft_ms):
            continue
        ttfts.append(ttft_ms)
        marks = [root["start_ns"], route["end_ns"], prefill["start_ns"], prefill["end_ns"], decode["start_ns"]]
        marks.append(root["start_ns"] + ttft_ms * 1e6)
        for name, a, b in zip(SEGMENTS, marks, marks[1:]):
            segments[name].append((b - a) / 1e6)
    return {
        "num_requests": len(ttfts),
        "num_local_prefills": num_local,
        "ttft_p50_ms": _p50(ttfts),
        "ttft_segments_p50_ms": {name: _p50(values) for name, values in segments.items()},
        "kv_loads": num_loaded,
        "kv_loads_direct": num_direct,
        "kv_load_gb_s_p50": _p50(per_request_gb_s),
        "kv_load_gb_s_total": bytes_total / (ms_total * 1e-3) / 1e9 if ms_total else float("nan"),
        "kv_load_ms_p50": _p50(load_ms_values),
        "kv_copy_gb_s_p50": _p50(copy_gb_s),
        "decode_in_flight_max": _max_overlap(decode_intervals),
        **prefill_pace(prefill_intervals, decode_intervals),
    }


def level_breakdowns(trace_dir: str | Path, levels: list[dict[str, Any]]) -> None:
    """Add `mesh_trace` (breakdown) to each level that recorded its mesh windows."""
    spans = load_spans(trace_dir)
    for level in levels:
        windows = level.pop("mesh_windows", None)
        if windows:
            level["mesh_trace"] = breakdown(spans, windows)


def print_breakdowns(levels: list[dict[str, Any]]) -> None:
    rows = [(level["concurrency"], level["mesh_trace"]) for level in levels if "mesh_trace" in level]
    if not rows:
        return
    print("\nthe mesh's TTFT from its traces (p50 ms per hop; a hop < 0: its two spans overlap, e.g. decode began")
    print("before prefill's span closed),")
    print("the KV handoff's bandwidth (decode's kv.loaded_bytes over kv.load_ms; copy: over a direct copy's own kv.copy_ms),")
    print("decode's requests in flight, and")
    print("the requests conditional disaggregation prefilled on decode (those have no prefill hop: not in the TTFT split)")
    header = (
        f"{'conc':>4} | {'TTFT':>7} = {'route':>6} {'to pf':>6} {'prefill':>8} {'handoff':>8} {'out':>6} | "
        f"{'loads':>5} {'direct':>6} {'ms p50':>7} {'GB/s p50':>8} {'GB/s all':>8} {'copy GB/s':>9} | "
        f"{'decode in flight':>16} | "
        f"{'prefilled on decode':>19}"
    )
    print(header + "\n" + "-" * len(header))
    for conc, t in rows:
        seg = t["ttft_segments_p50_ms"]
        print(
            f"{conc:>4} | {t['ttft_p50_ms']:>7.1f} = {seg['route']:>6.1f} {seg['to_prefill']:>6.1f} "
            f"{seg['prefill']:>8.1f} {seg['handoff']:>8.1f} {seg['first_token_out']:>6.1f} | "
            f"{t['kv_loads']:>5} {t['kv_loads_direct']:>6} {t['kv_load_ms_p50']:>7.2f} {t['kv_load_gb_s_p50']:>8.2f} "
            f"{t['kv_load_gb_s_total']:>8.2f} {t.get('kv_copy_gb_s_p50', float('nan')):>9.2f} | "
            f"{t['decode_in_flight_max']:>16} | {t.get('num_local_prefills', 0):>19}"
        )
    print("\nprefill's pace (ms per prompt, p50): alone = decode spans covered under half its span; back to back = the")
    print("gap between two prefill ends while the next prompt was queued, with decode idle or stepping meanwhile")
    print(f"{'conc':>4} | {'alone':>7} | {'b2b, decode idle':>16} | {'b2b, decode busy':>16} {'n':>4}")
    for conc, t in rows:
        print(
            f"{conc:>4} | {t['prefill_alone_ms_p50']:>7.1f} | {t['prefill_back_to_back_decode_idle_ms_p50']:>16.1f} | "
            f"{t['prefill_back_to_back_decode_busy_ms_p50']:>16.1f} {t['prefill_back_to_back_decode_busy_n']:>4}"
        )
