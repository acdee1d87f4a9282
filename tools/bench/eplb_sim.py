"""EPLB placement quality and cost (issue 28, point 5), a simulation labelled as one:
routing is a synthetic trace (shared/engine/eplb/traces.py: per-expert loads
log-normal, drifting), not a model's. Per EP size, the placement is recomputed every
`interval` steps from the last `window` steps and judged on the steps that follow it,
so the drift counts against it. Printed per layer (min and median over the layers):

- interval: balancedness (mean/max tokens per rank) of the counts summed over each
  following interval, averaged over intervals: what a placement controls;
- step: the same per step, averaged: with the Poisson noise of one step's batch,
  which no placement removes;
- bound: for no redundant experts, the best any placement could do on the interval
  counts: mean tokens per rank / tokens of the hottest expert.

Policies: static (expert i on rank i // per_rank), EPLB global with 0 and 1 redundant
experts per rank, and for 256 experts (8 groups, DeepSeek's shape) EPLB hierarchical
with 8 ranks per node. Then the placement's compute time at 48 layers x 128 experts.

  python -m tools.bench.eplb_sim --out docs/perf/eplb_sim_cpu_2026-12-06.txt
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from shared.engine.eplb.load_window import LoadWindow, balancedness
from shared.engine.eplb.placement import Placement, PlacementSpec, compute_placement, static_placement
from shared.engine.eplb.traces import DriftingLogNormalTrace, TraceSpec
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows

RANKS_PER_NODE = 8
NUM_GROUPS = 8  # DeepSeek-V3's expert groups, for the hierarchical rows


@dataclass(frozen=True)
class SimConfig:
    num_layers: int
    window: int
    interval: int
    num_intervals: int
    trace: TraceSpec


def policies(num_experts: int, ranks: int) -> dict[str, PlacementSpec | None]:
    """Name -> spec; None is the static placement."""
    named: dict[str, PlacementSpec | None] = {
        "static": None,
        "eplb r0": PlacementSpec.per_rank(ranks, 0),
        "eplb r1": PlacementSpec.per_rank(ranks, 1),
    }
    if num_experts % NUM_GROUPS == 0 and num_experts >= 256:
        nodes = ranks // RANKS_PER_NODE
        named["eplb-hier r1"] = PlacementSpec.per_rank(ranks, 1, num_nodes=nodes, num_groups=NUM_GROUPS)
    return named


def simulate(cfg: SimConfig, ranks: int) -> list[dict]:
    """One trace, every policy judged on the same steps."""
    trace = DriftingLogNormalTrace(cfg.trace)
    window = LoadWindow(cfg.num_layers, cfg.trace.num_experts, cfg.window)
    for _ in range(cfg.window):
        window.record(trace.step())
    named = policies(cfg.trace.num_experts, ranks)
    static = static_placement(cfg.num_layers, cfg.trace.num_experts, ranks)
    per_interval: dict[str, list[np.ndarray]] = {n: [] for n in named}
    per_step: dict[str, list[np.ndarray]] = {n: [] for n in named}
    bound: list[np.ndarray] = []
    times: dict[str, list[float]] = {n: [] for n in named}
    for _ in range(cfg.num_intervals):
        load = window.total()
        placements: dict[str, Placement] = {}
        for name, spec in named.items():
            start = time.perf_counter()
            placements[name] = static if spec is None else compute_placement(load, spec)
            times[name].append(time.perf_counter() - start)
        steps = trace.steps(cfg.interval)
        for counts in steps:
            window.record(counts)
        summed = steps.sum(0)
        for name, placement in placements.items():
            per_interval[name].append(balancedness(summed, placement))
            per_step[name].append(balancedness(steps, placement).mean(0))
        bound.append(np.minimum(summed.sum(1) / ranks / summed.max(1), 1.0))
    bound_layers = np.mean(bound, axis=0)
    rows = []
    for name in named:
        interval = np.mean(per_interval[name], axis=0)
        step = np.mean(per_step[name], axis=0)
        rows.append({
            "policy": name, "interval_min": interval.min(), "interval_median": float(np.median(interval)),
            "step_min": step.min(), "step_median": float(np.median(step)),
            "bound_median": float(np.median(bound_layers)) if name == "eplb r0" else None,
            "placement_ms": 1e3 * statistics.median(times[name]) if named[name] is not None else None,
        })
    return rows


def time_placement(num_layers: int, num_experts: int, spec: PlacementSpec, repeats: int, sigma: float) -> list[float]:
    """ms per compute_placement on log-normal loads (a fresh draw per repeat)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(repeats):
        load = rng.lognormal(0.0, sigma, size=(num_layers, num_experts)) * 1000
        start = time.perf_counter()
        compute_placement(load, spec)
        out.append(1e3 * (time.perf_counter() - start))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eplb_sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, nargs="+", default=[128, 256])
    p.add_argument("--ep", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--sigma", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--drift-steps", type=float, nargs="+", default=[200_000.0, 20_000.0],
                   help="correlation times of the drift (steps): slow, and a faster mix")
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--interval", type=int, default=1000)
    p.add_argument("--intervals", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30, help="placement timings per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    add_json_flag(p)
    args = p.parse_args(argv)

    rows: list[dict] = []
    timings: list[dict] = []
    with tee_stdout(args.out):
        print(f"# trace: log-normal per-expert load (sigma as below, assumed, not fitted by us), "
              f"{args.tokens_per_step} tokens x top-{args.top_k} per step, drift correlation as below (steps); "
              f"window {args.window}, interval {args.interval}, {args.intervals} intervals judged; {args.layers} layers")
        print("# balancedness = mean/max tokens per rank, per layer; min and median over layers")
        header = f"{'sigma':>5} {'drift':>7} {'experts':>7} {'EP':>3} {'policy':<13} {'interval min':>12} {'interval med':>12} " \
                 f"{'step min':>8} {'step med':>8} {'bound r0':>8} {'place ms':>8}"
        print(header)
        cases = [(s, d, e, r) for s in args.sigma for d in args.drift_steps for e in args.experts for r in args.ep]
        for sigma, drift, experts, ranks in cases:
            trace = TraceSpec(args.layers, experts, sigma, args.tokens_per_step, args.top_k, drift, seed=args.seed)
            cfg = SimConfig(args.layers, args.window, args.interval, args.intervals, trace)
            for row in simulate(cfg, ranks):
                rows.append({"sigma": sigma, "drift_steps": drift, "experts": experts, "ep": ranks, **row})
                bound = "" if row["bound_median"] is None else f"{row['bound_median']:.3f}"
                ms = "" if row["placement_ms"] is None else f"{row['placement_ms']:.1f}"
                print(f"{sigma:>5} {drift:>7g} {experts:>7} {ranks:>3} {row['policy']:<13} {row['interval_min']:>12.3f} "
                      f"{row['interval_median']:>12.3f} {row['step_min']:>8.3f} {row['step_median']:>8.3f} "
                      f"{bound:>8} {ms:>8}")
            sys.stdout.flush()
        print()
        print(f"# placement compute time, {args.layers} layers, ms over {args.repeats} repeats (fresh load each)")
        for experts in args.experts:
            for name, spec in (
                ("global r0", PlacementSpec.per_rank(64, 0)),
                ("global r1", PlacementSpec.per_rank(64, 1)),
                ("hier r1 (8 nodes, 8 groups)", PlacementSpec.per_rank(64, 1, num_nodes=8, num_groups=NUM_GROUPS)),
            ):
                ms = time_placement(args.layers, experts, spec, args.repeats, args.sigma[0])
                timings.append({"experts": experts, "ep": 64, "placement": name, "median_ms": statistics.median(ms),
                                "runs_ms": ms})  # fmt: skip
                print(f"{args.layers}x{experts}xEP64 {name:<28} median {statistics.median(ms):7.2f}  "
                      f"min {min(ms):7.2f}  max {max(ms):7.2f}")
    write_rows(args.json, rows, placement_times=timings, layers=args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
