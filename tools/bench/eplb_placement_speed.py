"""EPLB placement compute time and balance, this tree's placement against a baseline
revision's, side by side in one process (issue 28, point 5: <= 5 ms for 48 layers x
128 experts x EP64).

Timing: per case, `--repeats` fresh seeded log-normal loads (the draw of
tools/bench/eplb_sim.py's timing rows); after `--warmup` calls each, the baseline and
this tree alternate on the same load, so that a noisy, shared CPU disturbs both
alike. Printed: min, median and max ms of each.

Balance: one seeded drifting trace (shared/engine/eplb/traces.py), a window of
`--window` steps; both placements are computed from the window's summed counts and
judged per layer (mean/max tokens per rank) on the window itself ("own": what the
packing controls) and on the `--window` steps after it ("next": with the drift).
Printed: min and median over the layers.

  python -m tools.bench.eplb_placement_speed --out docs/perf/eplb_placement_speed_cpu_2026-12-06.txt
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from shared.engine.eplb import placement as current
from shared.engine.eplb.load_window import balancedness
from shared.engine.eplb.traces import DriftingLogNormalTrace, TraceSpec
from tools.bench.raw_file import ROOT, add_json_flag, tee_stdout, write_rows

PLACEMENT = "shared/engine/eplb/placement.py"


def load_baseline(rev: str) -> ModuleType:
    """The placement module as it is at `rev`, imported under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{PLACEMENT}"], capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "eplb_placement_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("eplb_placement_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(experts: list[int], layers: int) -> list[tuple[str, int, dict]]:
    out = []
    for e in experts:
        out += [
            (f"{layers}x{e}xEP64 global r0", e, {"num_ranks": 64, "redundant_per_rank": 0}),
            (f"{layers}x{e}xEP64 global r1", e, {"num_ranks": 64, "redundant_per_rank": 1}),
            (f"{layers}x{e}xEP64 hier r1 (8 nodes, 8 groups)", e,
             {"num_ranks": 64, "redundant_per_rank": 1, "num_nodes": 8, "num_groups": 8}),
        ]
    return out


def spec_of(module: ModuleType, kw: dict):
    return module.PlacementSpec.per_rank(**kw)


def stats(ms: list[float]) -> str:
    return f"min {min(ms):7.2f}  median {statistics.median(ms):7.2f}  max {max(ms):7.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eplb_placement_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", default=None,
                   help="git revision whose placement.py is the baseline (default: where this branch left main); "
                        "'none' where there is no git (the device machine's copy): this tree's code is timed twice")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, nargs="+", default=[128])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sigma", type=float, default=0.5)
    p.add_argument("--window", type=int, default=200, help="trace steps placed from, and judged on after")
    p.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.baseline_rev is None:
        args.baseline_rev = subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], capture_output=True,
                                           text=True, check=True).stdout.strip()
    if args.baseline_rev == "none":
        base, base_commit = current, "none: this tree's code, timed twice"
    else:
        base = load_baseline(args.baseline_rev)
        base_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline_rev],
                                     capture_output=True, text=True, check=True).stdout.strip()

    timings: list[dict] = []
    balance: list[dict] = []
    with tee_stdout(args.out):
        print(f"# baseline: {PLACEMENT} at {args.baseline_rev} ({base_commit}); new: this tree's")
        print(f"# timing: ms per compute_placement, {args.layers} layers, log-normal loads sigma {args.sigma}, "
              f"{args.repeats} fresh loads (seed 1), {args.warmup} warm-up calls each, baseline and new alternating on "
              f"each load")
        for name, experts, kw in cases(args.experts, args.layers):
            rng = np.random.default_rng(1)
            loads = [rng.lognormal(0.0, args.sigma, size=(args.layers, experts)) * 1000 for _ in range(args.repeats)]
            for load in loads[: args.warmup]:
                base.compute_placement(load, spec_of(base, kw))
                current.compute_placement(load, spec_of(current, kw))
            old_ms, new_ms = [], []
            for load in loads:
                for module, out in ((base, old_ms), (current, new_ms)):
                    spec = spec_of(module, kw)
                    start = time.perf_counter()
                    module.compute_placement(load, spec)
                    out.append(1e3 * (time.perf_counter() - start))
            timings.append({"case": name, "baseline_ms": old_ms, "new_ms": new_ms,
                            "median_speedup": statistics.median(old_ms) / statistics.median(new_ms)})  # fmt: skip
            print(f"{name:<38} baseline {stats(old_ms)}")
            print(f"{'':<38} new      {stats(new_ms)}   median speedup {statistics.median(old_ms) / statistics.median(new_ms):4.1f}x")
        sys.stdout.flush()

        print()
        print(f"# balance: mean/max tokens per rank per layer (min / median over {args.layers} layers); trace sigma "
              f"{args.sigma}, drift 200000 steps, 8192 tokens x top-8 per step, seed 0; placed from {args.window} steps, "
              f"judged on them (own) and on the {args.window} after (next)")
        print(f"{'experts':>7} {'EP':>3} {'policy':<13} {'own base':>15} {'own new':>15} {'next base':>15} {'next new':>15}")
        for experts in args.experts:
            trace = DriftingLogNormalTrace(TraceSpec(args.layers, experts, args.sigma, 8192, 8, 200_000.0, seed=0))
            window = trace.steps(args.window).sum(0)
            future = trace.steps(args.window).sum(0)
            rows = [(16, "eplb r1", {"num_ranks": 16, "redundant_per_rank": 1}),
                    (32, "eplb r1", {"num_ranks": 32, "redundant_per_rank": 1}),
                    (64, "eplb r0", {"num_ranks": 64, "redundant_per_rank": 0}),
                    (64, "eplb r1", {"num_ranks": 64, "redundant_per_rank": 1}),
                    (64, "eplb-hier r1", {"num_ranks": 64, "redundant_per_rank": 1, "num_nodes": 8, "num_groups": 8})]
            for ranks, policy, kw in rows:
                cells = []
                row: dict = {"experts": experts, "ep": ranks, "policy": policy}
                for judged_name, judged in (("own", window), ("next", future)):
                    for module_name, module in (("base", base), ("new", current)):
                        b = balancedness(judged, module.compute_placement(window, spec_of(module, kw)))
                        cells.append(f"{b.min():.4f}/{np.median(b):.4f}")
                        row[f"{judged_name}_{module_name}"] = {"min": float(b.min()), "median": float(np.median(b))}
                balance.append(row)
                print(f"{experts:>7} {ranks:>3} {policy:<13} " + " ".join(f"{c:>15}" for c in cells))
    write_rows(args.json, timings, balance=balance, baseline=f"{args.baseline_rev} ({base_commit})", layers=args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
