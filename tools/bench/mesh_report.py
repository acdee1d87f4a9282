"""bench-mesh's printed report: the headline first (the mesh against the engine behind
HTTP, per-round ratios), then every target's figures, each a median with the spread
of the timed rounds; the trace tables follow (mesh_traces.print_breakdowns)."""

from collections.abc import Mapping
from typing import Any

from tools.bench.rounds import DROPPED_ROUNDS, HEADLINE, Run


def spread_text(s: Mapping[str, float], fmt: str = ".2f") -> str:
    """median (min–max)"""
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def print_progress(run: Run, row: Mapping[str, Any]) -> None:
    """One line per run as it ends, so that a run cut short still shows what it measured."""
    kind = "warm-up" if run.round is None else f"round {run.round}" + ("" if run.timed else " (dropped)")
    print(
        f"  conc {run.concurrency:>3} {kind:<17} {run.target:<6} {row['out_tok_s']:>9.1f} tok/s  "
        f"TTFT p50 {row['ttft_p50_ms']:>8.1f} ms  TPOT p50 {row['tpot_p50_ms']:>7.2f} ms",
        flush=True,
    )


def print_headline(levels: list[dict[str, Any]], num_rounds: int) -> None:
    a, b = HEADLINE
    print(f"\nHEADLINE: {a} against {b} (the same engine behind the OpenAI API in one process, the strongest baseline);")
    print(f"ratios taken per round between runs side by side, then median (min–max) of the {num_rounds} rounds' ratios")
    if not any(level["headline"] for level in levels):
        print(f"  not measured: the {b} target did not run (the in-process engine is never the baseline)")
        return
    header = f"{'conc':>4} | {'tok/s ratio':>20} | {'TTFT ratio':>20} | {'added ms/req':>24} | {'added ms/tok':>20}"
    print(header + "\n" + "-" * len(header))
    for level in levels:
        h = level["headline"]
        if h is None:
            continue
        print(
            f"{level['concurrency']:>4} | {spread_text(h['tok_s_ratio']):>20} | {spread_text(h['ttft_ratio']):>20} | "
            f"{spread_text(h['added_ms_per_request'], '.1f'):>24} | {spread_text(h['added_ms_per_token']):>20}"
        )


def print_targets(levels: list[dict[str, Any]], num_rounds: int) -> None:
    print(f"\nevery target: median (min–max) of {num_rounds} timed rounds, after a warm-up at each level and "
          f"{DROPPED_ROUNDS} dropped round")  # fmt: skip
    header = (
        f"{'conc':>4} {'target':<6} | {'out tok/s':>22} | {'TTFT p50 ms':>22} | {'TTFT p90 ms':>10} | "
        f"{'TPOT p50 ms':>20} | {'E2E p50 ms':>10}"
    )
    print(header + "\n" + "-" * len(header))
    for level in levels:
        for target, s in level["rows"].items():
            print(
                f"{level['concurrency']:>4} {target:<6} | {spread_text(s['out_tok_s'], '.1f'):>22} | "
                f"{spread_text(s['ttft_p50_ms'], '.1f'):>22} | {s['ttft_p90_ms']['median']:>10.1f} | "
                f"{spread_text(s['tpot_p50_ms']):>20} | {s['e2e_p50_ms']['median']:>10.1f}"
            )
    layers = [level for level in levels if level["http_layer"]]
    if layers:
        print("\nthe OpenAI layer's own cost (http - engine, p50s, per round; a difference, not a baseline):")
        for level in layers:
            h = level["http_layer"]
            print(f"{level['concurrency']:>4} | {spread_text(h['added_ms_per_request'], '.1f')} ms/req | "
                  f"{spread_text(h['added_ms_per_token'])} ms/tok")  # fmt: skip
