"""bench-vision-goodput's arithmetic (tools/bench/vision_goodput.py), apart from any
timing: which requests count as goodput, per-round ratios that skip a zero baseline, and
which spans of a trace are the embedding handoff."""

import pytest

from tools.bench import vision_goodput
from tools.bench.openai_stream import RequestResult
from tools.bench.vision_goodput import ARM, ARMS, BASELINE, request_specs, summarize, trace_figures


def _result(ttft_ms: float, tpot_ms: float, tokens: int = 5) -> RequestResult:
    r = RequestResult(True, 0.0, ttft_s=ttft_ms / 1000, num_output_tokens=tokens)
    r.e2e_s = r.ttft_s + tpot_ms / 1000 * (tokens - 1)
    return r


def test_goodput_counts_requests_meeting_both_targets() -> None:
    results = [_result(100, 10), _result(300, 10), _result(100, 30), _result(200, 20, tokens=1),
               RequestResult(False, 0.0, error="HTTP 503")]  # fmt: skip
    row = summarize(results, wall_s=2.0, ttft_target_ms=200, tpot_target_ms=20)
    # met: the first (100, 10) and the one-token answer at exactly the TTFT target (no TPOT)
    assert (row["ok"], row["failed"], row["good"]) == (4, 1, 2)
    assert row["goodput_req_s"] == pytest.approx(1.0)
    assert row["goodput_tok_s"] == pytest.approx((5 + 1) / 2.0)
    assert row["out_tok_s"] == pytest.approx((5 + 5 + 5 + 1) / 2.0)
    assert row["ttft_p50_ms"] == pytest.approx(150)
    assert row["tpot_p50_ms"] == pytest.approx(10)  # the one-token answer has none


def test_ratios_per_round_skip_a_baseline_of_zero() -> None:
    def row(goodput: float) -> dict:
        return {m: goodput for m in vision_goodput.RATIO_METRICS}

    rounds = [{ARM: row(2.0), BASELINE: row(1.0)}, {ARM: row(1.0), BASELINE: row(0.0)},
              {ARM: row(3.0), BASELINE: row(1.0)}]  # fmt: skip
    r = vision_goodput.ratios(rounds)["goodput_req_s"]
    assert r == {"rounds_with_ratio": 2, "median": 2.5, "min": 2.0, "max": 3.0}


def _span(trace: str, sid: str, parent: str | None, name: str, start: int, end: int, **attrs) -> dict:
    return {"trace_id": trace, "span_id": sid, "parent_id": parent, "name": name, "start_ns": start, "end_ns": end,
            "attributes": attrs}


def test_the_handoff_is_prefills_transfer_of_image_embeddings_in_the_window() -> None:
    ms = 1_000_000
    spans = [
        _span("t1", "r1", None, "chat", 100 * ms, 900 * ms, **{"request.id": "a"}),
        _span("t1", "v1", "r1", "vision", 110 * ms, 150 * ms, **{"request.id": "a", "vision.site": "vision"}),
        _span("t1", "e1", "v1", "encode", 115 * ms, 145 * ms),
        _span("t1", "p1", "r1", "prefill", 160 * ms, 300 * ms, **{"request.id": "a"}),
        _span("t1", "x1", "p1", "transfer", 161 * ms, 165 * ms, **{"transfer.what": "image_embeddings",
              "transfer.path": "peer", "transfer.outcome": "hit", "transfer.bytes": 8_000_000}),  # fmt: skip
        _span("t1", "d1", "r1", "decode", 300 * ms, 900 * ms, **{"request.id": "a"}),
        # decode's own fetch (off the TTFT path) is not the handoff
        _span("t1", "x2", "d1", "transfer", 301 * ms, 340 * ms, **{"transfer.what": "image_embeddings"}),
        # another request, outside the window
        _span("t2", "r2", None, "chat", 5000 * ms, 5100 * ms, **{"request.id": "b"}),
        _span("t2", "p2", "r2", "prefill", 5001 * ms, 5050 * ms, **{"request.id": "b"}),
        _span("t2", "x3", "p2", "transfer", 5002 * ms, 5003 * ms, **{"transfer.what": "image_embeddings"}),
        # aggregated: decode prefilled it and ran the processor on the PNGs
        _span("t3", "r3", None, "chat", 200 * ms, 400 * ms, **{"request.id": "c"}),
        _span("t3", "d3", "r3", "decode", 210 * ms, 400 * ms, **{"request.id": "c", "prefill.local": True}),
        _span("t3", "i3", "d3", "images", 211 * ms, 213 * ms),
    ]  # fmt: skip
    t = trace_figures(spans, [(0, 1000 * ms)])
    assert (t["requests"], t["prefilled_on_decode"]) == (2, 1)
    assert (t["handoff_n"], t["handoff_ms_p50"]) == (1, 4.0)
    assert t["handoff_paths"] == {"peer:hit": 1}
    assert t["handoff_mb_p50"] == 8.0 and t["handoff_gb_s_p50"] == pytest.approx(2.0)
    assert (t["encode_ms_p50"], t["vision_ms_p50"], t["images_ms_p50"]) == (30.0, 40.0, 2.0)
    assert trace_figures(spans, [(4000 * ms, 6000 * ms)])["handoff_n"] == 1
    assert trace_figures(spans, [(2000 * ms, 3000 * ms)])["requests"] == 0


def test_a_rounds_requests_are_seeded_distinct_and_carry_the_images() -> None:
    a = request_specs((0, 1), 3, images=4, px=40, max_tokens=8)
    assert request_specs((0, 1), 3, images=4, px=40, max_tokens=8) == a
    urls = [p["image_url"]["url"] for s in a for p in s.messages[0]["content"] if p["type"] == "image_url"]
    assert len(urls) == 12 and len(set(urls)) == 12
    other = request_specs((0, 2), 3, images=4, px=40, max_tokens=8)
    assert not {p["image_url"]["url"] for s in other for p in s.messages[0]["content"] if p["type"] == "image_url"} & set(urls)


def test_the_aggregated_arm_prefills_every_prompt_on_decode_without_a_vision_instance() -> None:
    assert ARMS[ARM].num_vision == 1 and not ARMS[ARM].env
    base = ARMS[BASELINE]
    assert base.num_vision == 0
    assert int(base.env["INFERMESH_BALANCER__LOCAL_PREFILL_MAX_TOKENS"]) > 1_000_000
