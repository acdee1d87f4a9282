"""The planner's replay simulator (issue 30, point 4): one seeded arrival trace (a
diurnal 20-80 req/s day with bursts, tools/planner/trace.py) replayed against a "true"
mesh built from a profile but slower than it by hidden factors
(tools/planner/true_system.py), with instances that take `startup_s` to become ready.
Three policies on the same trace (tools/planner/policies.py): the planner in the loop,
the best fixed allocation known in hindsight, and an HPA-like threshold autoscaler.

    python -m tools.planner.simulator --profile docs/perf/profiles/synthetic_8b_h100.json \
        --out docs/perf/planner_sim_cpu_2026-12-07.txt

Figures, as ratios on one trace: intervals meeting the target (p90 TTFT and ITL), the
planner's GPU-hours over the best fixed allocation's (issue target <= 1.10), its
goodput (requests within both targets) over the threshold autoscaler's (>= 1.40), and
the threshold autoscaler's requests over target over the planner's (>= 10).
"""

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Protocol

from services.planner.plan import Targets
from services.planner.profile import Profile
from tools.planner.policies import SIM_STAGES, FixedPolicy, PlannerPolicy, Seen, ThresholdPolicy
from tools.planner.trace import Interval, TraceSpec, make_trace
from tools.planner.true_system import TrueMesh


class Policy(Protocol):
    def decide(self, seen: Seen) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class SimSpec:
    ttft_ms: float = 600.0
    itl_ms: float = 30.0
    percentile: float = 90.0
    prefix_hit: float = 0.3
    hidden: tuple[tuple[str, float], ...] = (("prefill", 1.25), ("decode", 1.15))
    """How much slower the true mesh is than the profile, per stage (the planner is not told)."""
    startup_s: float = 360.0
    """From an instance asked for to it serving (pod start and model load)."""


@dataclass(frozen=True, slots=True)
class Run:
    intervals: int
    intervals_met: int
    requests: int
    over_target: float
    """Requests whose own TTFT or ITL is over the target's value (a p90 target lets 10 % be)."""
    in_missed_intervals: int
    """Requests of intervals whose percentile missed a target."""
    gpu_hours: float
    peak: dict[str, int]

    @property
    def met_share(self) -> float:
        return self.intervals_met / self.intervals

    @property
    def goodput(self) -> float:
        return self.requests - self.over_target


def simulate(trace: list[Interval], spec: SimSpec, trace_spec: TraceSpec, profile: Profile, policy: Policy,
             initial: dict[str, int]) -> Run:
    mesh = TrueMesh(profile, dict(spec.hidden), spec.prefix_hit, spec.percentile, spec.ttft_ms, spec.itl_ms,
                    trace_spec.interval_s)
    delay = math.ceil(spec.startup_s / trace_spec.interval_s)
    ready = dict(initial)
    starting: dict[str, list[int]] = {s: [] for s in SIM_STAGES}  # the interval each starting instance is ready in
    backlog = (0.0, 0.0)
    met = requests = in_missed = 0
    over = gpu_hours = 0.0
    peak = dict(initial)
    for i, arrivals in enumerate(trace):
        for s in SIM_STAGES:
            ready[s] += sum(1 for t in starting[s] if t <= i)
            starting[s] = [t for t in starting[s] if t > i]
        outcome = mesh.step(ready["prefill"], ready["decode"], arrivals, *backlog)
        allocated = {s: ready[s] + len(starting[s]) for s in SIM_STAGES}
        gpu_hours += sum(allocated[s] * profile.devices_per_instance.get(s, 1) for s in SIM_STAGES) \
            * trace_spec.interval_s / 3600  # starting instances hold their GPUs too
        ok = outcome.ttft_ms <= spec.ttft_ms and outcome.itl_ms <= spec.itl_ms
        met += ok
        in_missed += 0 if ok else outcome.requests
        requests += outcome.requests
        over += outcome.over_target
        want = policy.decide(Seen(arrivals, outcome, allocated, trace_spec.interval_s, backlog))
        backlog = (outcome.prefill_backlog, outcome.decode_backlog)
        for s in SIM_STAGES:
            target = max(want[s], 1)
            while ready[s] + len(starting[s]) < target:
                starting[s].append(i + 1 + delay)
            while ready[s] + len(starting[s]) > target:  # cancel the latest start first, then drain a ready one
                if starting[s]:
                    starting[s].pop()
                else:
                    ready[s] -= 1
            peak[s] = max(peak[s], ready[s] + len(starting[s]))
    return Run(len(trace), met, requests, over, in_missed, gpu_hours, peak)


def best_fixed(trace: list[Interval], spec: SimSpec, trace_spec: TraceSpec, profile: Profile,
               share: float = 0.99, ceiling: int = 256) -> tuple[dict[str, int], Run]:
    """The fewest instances per stage that meet the target in >= `share` of intervals,
    each stage searched with the other at `ceiling` (stages are separable: prefill sets
    TTFT, decode ITL), then both together, raising whichever stage misses until it holds."""

    def meets(alloc: dict[str, int]) -> bool:
        return simulate(trace, spec, trace_spec, profile, FixedPolicy(alloc), alloc).met_share >= share

    alloc = {s: ceiling for s in SIM_STAGES}
    for s in SIM_STAGES:
        lo, hi = 1, ceiling
        if not meets(alloc):
            raise ValueError(f"no fixed allocation up to {ceiling} instances meets the target in {share:.0%}")
        while lo < hi:  # meeting the target is monotone in the count: bisect
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if meets({**alloc, s: mid}) else (mid + 1, hi)
        alloc[s] = lo
    run = simulate(trace, spec, trace_spec, profile, FixedPolicy(alloc), alloc)
    return alloc, run


def compare(profile: Profile, spec: SimSpec, trace_spec: TraceSpec, headroom: float = 1.0) -> dict[str, object]:
    trace = make_trace(trace_spec)
    targets = Targets(spec.ttft_ms, spec.itl_ms, spec.percentile)
    lookahead = math.ceil(spec.startup_s / trace_spec.interval_s) + 1
    planner = PlannerPolicy(profile, targets, spec.prefix_hit, lookahead, headroom=headroom)
    fixed_alloc, fixed = best_fixed(trace, spec, trace_spec, profile)
    # Both adaptive policies start where the uncorrected planner puts the first interval.
    first = planner.decide(Seen(trace[0], _idle(trace[0]), {s: 1 for s in SIM_STAGES}, trace_spec.interval_s, (0, 0)))
    planner = PlannerPolicy(profile, targets, spec.prefix_hit, lookahead, headroom=headroom)
    planned = simulate(trace, spec, trace_spec, profile, planner, first)
    threshold = simulate(trace, spec, trace_spec, profile, ThresholdPolicy(), first)
    return {"trace": trace_spec, "sim": spec, "fixed_allocation": fixed_alloc, "initial": first, "planner": planned,
            "threshold": threshold, "fixed": fixed, "factors": planner.factors(),
            "planner_infeasible_intervals": planner.infeasible, "headroom": headroom}


def _idle(arrivals: Interval):
    from tools.planner.true_system import Outcome

    return Outcome(0.0, 0.0, 0.0, arrivals.requests, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0)


def report(result: dict[str, object], profile: Profile) -> str:
    p, t, f = result["planner"], result["threshold"], result["fixed"]
    lines = [f"profile: {profile.model} on {profile.device} ({profile.settings.get('source', profile.command)})",
             f"trace: {result['trace']}", f"sim: {result['sim']}",
             f"best fixed allocation (hindsight): {result['fixed_allocation']}; adaptive start: {result['initial']}",
             f"planner's correction factors at the end: "
             + ", ".join(f"{k} {v:.3f}" for k, v in result["factors"].items())
             + f" (hidden: {dict(result['sim'].hidden)}); infeasible plans: {result['planner_infeasible_intervals']}",
             f"planner headroom: {result['headroom']:g}x the forecast's request rate",
             "",
             "over: requests over a target's value themselves; in missed: requests of intervals whose p"
             f"{result['sim'].percentile:g} missed",
             f"{'policy':<10} {'met':>8} {'GPU-h':>9} {'requests':>10} {'over':>10} {'in missed':>10} {'goodput':>10}"
             f" {'peak':>22}"]
    for name, run in (("planner", p), ("fixed", f), ("threshold", t)):
        lines.append(f"{name:<10} {run.met_share:>8.2%} {run.gpu_hours:>9.1f} {run.requests:>10} "
                     f"{run.over_target:>10.0f} {run.in_missed_intervals:>10} {run.goodput:>10.0f} {str(run.peak):>22}")
    over_ratio = t.over_target / p.over_target if p.over_target else float("inf")
    missed_ratio = t.in_missed_intervals / p.in_missed_intervals if p.in_missed_intervals else float("inf")
    lines += ["",
              f"intervals meeting the target: planner {p.met_share:.2%} (issue: >= 99%)",
              f"GPU-hours planner / best fixed: {p.gpu_hours / f.gpu_hours:.3f}x (issue: <= 1.10x)",
              f"goodput planner / threshold: {p.goodput / t.goodput:.3f}x (issue: >= 1.40x)",
              f"requests over target threshold / planner: {over_ratio:.1f}x fewer (issue: >= 10x)",
              f"requests in missed intervals threshold / planner: {missed_ratio:.1f}x fewer"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools.bench.raw_file import run_header, tee_stdout

    parser = argparse.ArgumentParser(prog="python -m tools.planner.simulator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", help="the raw file (header: commit, device, command)")
    parser.add_argument("--intervals", type=int, default=TraceSpec().intervals)
    parser.add_argument("--seed", type=int, default=TraceSpec().seed)
    parser.add_argument("--bursts", type=int, default=TraceSpec().bursts, help="bursts in the trace (0: diurnal only)")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="the planner sizes for this many times the forecast's request rate")
    args = parser.parse_args(argv)
    profile = Profile.load(args.profile)
    with tee_stdout(args.out, run_header() if args.out else None):
        trace_spec = TraceSpec(intervals=args.intervals, seed=args.seed, bursts=args.bursts)
        print(report(compare(profile, SimSpec(), trace_spec, args.headroom), profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
