"""`infermesh bench-mesh`: the figures' arithmetic exactly, then one tiny run
against the real targets (the mesh as real processes), checking the structure
and sanity of the figures, never a timing threshold."""

import json
import math

import pytest

from tests.helpers.hf_models import save_tiny_hf_model
from tools.bench.mesh_traces import breakdown, prefill_pace
from tools.bench.mesh_bench import TARGETS, Timing, engine_setup, run_mesh_bench, summarize
from tools.bench.rounds import pair
from tools.cli import main

PROMPT_LEN, OUTPUT_LEN, NUM_REQUESTS = 32, 8, 4


def test_summarize_and_compare_are_exact():
    timings = [Timing(0.010, 0.080, 8, 8, 0), Timing(0.030, 0.100, 8, 8, 16)]
    row = summarize(timings, wall_s=0.5)
    assert row["num_completed"] == 2 and row["output_tokens"] == [8, 8] and row["cached_tokens"] == 16
    assert row["req_s"] == pytest.approx(4.0) and row["out_tok_s"] == pytest.approx(32.0)
    assert row["ttft_p50_ms"] == pytest.approx(20.0) and row["ttft_p90_ms"] == pytest.approx(28.0)
    assert row["tpot_p50_ms"] == pytest.approx(10.0)  # (80 - 10) / 7 and (100 - 30) / 7
    assert row["e2e_p50_ms"] == pytest.approx(90.0)
    slower = summarize([Timing(0.050, 0.190, 8, 8, 0)], wall_s=1.0)
    m = pair(slower, row)
    assert m["tok_s_ratio"] == pytest.approx(8.0 / 32.0) and m["ttft_ratio"] == pytest.approx(2.5)
    assert m["added_ms_per_request"] == pytest.approx(30.0) and m["added_ms_per_token"] == pytest.approx(10.0)


def test_cli_flags_and_the_environment_reach_the_benchmark(tmp_path, monkeypatch, capsys):
    """A run from the command line (the engine target alone): its flags are in the
    figures' config and shaped the run; an engine knob not given comes from the
    environment, as in the mesh's services, and only the knobs given are exported
    to the mesh's processes over that environment. Both raw files carry the header;
    without the http target there is no headline (the engine does not stand in)."""
    save_tiny_hf_model("llama", tmp_path / "model")  # token-id prompts: no tokenizer needed
    monkeypatch.setenv("INFERMESH_ENGINE__MAX_NUM_SEQS", "5")
    args = ["bench-mesh", "--model", str(tmp_path / "model"), "--targets", "engine", "--concurrency", "2",
            "--num-requests", "3", "--rounds", "3", "--prompt-len", "16", "--output-len", "3",
            "--block-size", "8", "--no-enable-prefix-caching", "--json", str(tmp_path / "figures.json"),
            "--log", str(tmp_path / "bench.log")]
    assert main(args) == 0
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert set(figures["header"]) >= {"commit", "device", "command", "date", "versions"}
    log = (tmp_path / "bench.log").read_text()
    assert log.startswith("# commit: ") and log.index("HEADLINE") < log.index("every target")
    assert "not measured: the http target did not run" in log
    config = figures["config"]
    assert (config["prompt_len"], config["output_len"], config["num_requests"], config["num_rounds"]) == (16, 3, 3, 3)
    assert config["targets"] == ["engine"] and [level["concurrency"] for level in figures["levels"]] == [2]
    level = figures["levels"][0]
    assert level["headline"] is None and len(level["rounds"]) == 3 and len(level["dropped_rounds"]) == 1
    assert all(r["engine"]["output_tokens"] == [3, 3, 3] for r in level["rounds"])
    progress = [line.split()[2:4] for line in capsys.readouterr().out.splitlines() if line.startswith("  conc")]
    assert progress == [["warm-up", "engine"], ["round", "0"], ["round", "1"], ["round", "2"], ["round", "3"]]
    engine = config["engine"]
    assert (engine["block_size"], engine["enable_prefix_caching"], engine["max_num_seqs"]) == (8, False, 5)
    _, mesh_env = engine_setup("m", {"block_size": 8, "enable_prefix_caching": False})
    assert mesh_env == {
        "INFERMESH_ENGINE__MODEL": "m",
        "INFERMESH_ENGINE__BLOCK_SIZE": "8",
        "INFERMESH_ENGINE__ENABLE_PREFIX_CACHING": "False",
    }


def test_bad_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="output_len"):
        run_mesh_bench(None, [1], 4, PROMPT_LEN, 1)
    with pytest.raises(ValueError, match="at least 3 timed rounds"):
        run_mesh_bench(None, [1], 4, PROMPT_LEN, OUTPUT_LEN, num_rounds=2)
    with pytest.raises(ValueError, match="one per concurrency level"):
        run_mesh_bench(None, [1, 4], [4, 8, 16], PROMPT_LEN, OUTPUT_LEN)
    with pytest.raises(ValueError, match="targets"):
        run_mesh_bench(None, [1], 4, PROMPT_LEN, OUTPUT_LEN, targets=("engine", "gpu"))


def test_tiny_run_measures_every_target(tmp_path, capsys):
    figures = run_mesh_bench(
        model=None,
        concurrency=[1, 4],
        num_requests=[NUM_REQUESTS, 2 * NUM_REQUESTS],  # one count per level, per target and round
        prompt_len=PROMPT_LEN,
        output_len=OUTPUT_LEN,
        state_dir=str(tmp_path / "state"),
        json_path=str(tmp_path / "figures.json"),
    )
    written = json.loads((tmp_path / "figures.json").read_text())
    assert written.pop("header")["commit"] and written == json.loads(json.dumps(figures))
    assert [level["concurrency"] for level in figures["levels"]] == [1, 4]
    for level, num in zip(figures["levels"], [NUM_REQUESTS, 2 * NUM_REQUESTS]):
        assert len(level["rounds"]) == 3 and len(level["dropped_rounds"]) == 1
        for round_ in level["rounds"]:
            assert set(round_) == set(TARGETS)
            for target, row in round_.items():
                # Every request completed with exactly output_len tokens, counted as they arrived.
                assert row["num_completed"] == num, target
                assert row["output_tokens"] == [OUTPUT_LEN] * num, target
                assert row["usage_tokens"] == [OUTPUT_LEN] * num, target
                assert row["cached_tokens"] == 0, target  # distinct prompts: no prefix hit flatters anyone
                assert row["req_s"] > 0 and row["out_tok_s"] > 0
                assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"]
                assert 0 <= row["tpot_p50_ms"] and row["ttft_p50_ms"] <= row["e2e_p50_ms"]
        assert set(level["rows"]) == set(TARGETS)
        for s in level["rows"].values():
            assert s["out_tok_s"]["min"] <= s["out_tok_s"]["median"] <= s["out_tok_s"]["max"]
        h = level["headline"]
        assert len(h["per_round"]) == 3 and all(math.isfinite(p["tok_s_ratio"]) for p in h["per_round"])
        assert h["tok_s_ratio"]["min"] <= h["tok_s_ratio"]["median"] <= h["tok_s_ratio"]["max"]
        # The mesh's own traces, for exactly its timed rounds' requests: every prompt's KV
        # went straight from prefill to decode, and the hops add up to the TTFT.
        t = level["mesh_trace"]
        assert t["num_requests"] == 3 * num and t["kv_loads"] == t["kv_loads_direct"] == 3 * num
        assert t["kv_load_gb_s_p50"] > 0 and t["kv_load_gb_s_total"] > 0
        assert t["kv_copy_gb_s_p50"] >= t["kv_load_gb_s_p50"]  # the copy is part of the load's time
        assert 1 <= t["decode_in_flight_max"] <= level["concurrency"]
        assert sum(t["ttft_segments_p50_ms"].values()) > 0
    printed = capsys.readouterr().out
    assert printed.index("HEADLINE: mesh against http") < printed.index("every target")
    assert "added ms/req" in printed and "GB/s p50" in printed


def _span(name, rid, start_ms, end_ms, parent="p", **attrs):
    return {"name": name, "parent_id": parent, "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6),
            "attributes": {"request.id": rid, **attrs}}


def test_trace_breakdown_is_exact():
    spans = []
    for i, rid in enumerate(["a", "b"]):
        t0 = 1000 * i
        spans += [
            _span("POST /v1/completions", rid, t0, t0 + 100, parent=None, ttft_ms=40.0),
            _span("route", rid, t0 + 1, t0 + 3),
            _span("prefill", rid, t0 + 5, t0 + 30),
            _span("decode", rid, t0 + 29, t0 + 90, **{"kv.loaded_bytes": 2_000_000, "kv.load_ms": 0.5 * (i + 1),
                                                       "kv.copy_ms": 0.1 * (i + 1), "kv.loaded_direct": True}),
        ]
    spans.append(_span("POST /v1/completions", "late", 5000, 5100, parent=None, ttft_ms=1.0))  # another level
    t = breakdown(spans, [(0, int(2000 * 1e6))])
    assert t["num_requests"] == 2 and t["ttft_p50_ms"] == 40.0
    assert t["ttft_segments_p50_ms"] == pytest.approx(
        {"route": 3.0, "to_prefill": 2.0, "prefill": 25.0, "handoff": -1.0, "first_token_out": 11.0}
    )
    assert t["kv_loads"] == t["kv_loads_direct"] == 2
    assert t["kv_load_gb_s_p50"] == pytest.approx((4.0 + 2.0) / 2)  # 2 MB in 0.5 ms and in 1 ms
    assert t["kv_load_gb_s_total"] == pytest.approx(4e6 / 1.5e-3 / 1e9)
    assert t["kv_copy_gb_s_p50"] == pytest.approx((20.0 + 10.0) / 2)  # 2 MB copied in 0.1 ms and in 0.2 ms
    assert t["decode_in_flight_max"] == 1
    overlapping = spans + [_span("decode", "c", 50, 60), _span("decode", "d", 55, 58)]
    overlapping.append(_span("POST /v1/completions", "c", 40, 70, parent=None))
    overlapping.append(_span("POST /v1/completions", "d", 41, 70, parent=None))
    assert breakdown(overlapping, [(0, int(2000 * 1e6))])["decode_in_flight_max"] == 3


def test_prefill_pace_splits_prompts_by_whether_decode_was_stepping():
    ms = 1_000_000
    # Two prompts queued at once, the second finishing 40 ms after the first while
    # decode spans cover that gap; then a prompt alone (decode idle), then two more
    # back to back with decode idle between them.
    prefills = [(0, 25 * ms), (1 * ms, 65 * ms), (200 * ms, 225 * ms), (300 * ms, 330 * ms), (301 * ms, 360 * ms)]
    decodes = [(20 * ms, 70 * ms), (226 * ms, 240 * ms)]
    pace = prefill_pace(prefills, decodes)
    assert pace["prefill_back_to_back_decode_busy_ms_p50"] == pytest.approx(40.0)
    assert pace["prefill_back_to_back_decode_busy_n"] == 1
    assert pace["prefill_back_to_back_decode_idle_ms_p50"] == pytest.approx(30.0)
    # Decode covered 5 of the first prompt's 25 ms (alone) and 45 of the second's 64 (not):
    # alone are 25, 25, 30 and 59 ms.
    assert pace["prefill_alone_ms_p50"] == pytest.approx(27.5)
