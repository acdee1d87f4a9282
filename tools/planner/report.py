"""The sweep's raw file and printed report: every measured point with the median and
the min-max of its rounds, the points the budget left out, the held-out checks
(measured against predicted), and what the run could not measure, with the
machine's load average before and after (figures from a shared machine are noisy)."""

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.planner.profile import Profile
from tools.planner import holdout

TARGET_ERROR = 0.10
"""Issue 30's accuracy figure: predicted within 10 % of measured."""
_AXES = {"prefill": ("input_tokens", "concurrency"), "decode": ("batch", "context"),
         "vision": ("concurrency", "image_px"), "kvcache": ("input_tokens", "concurrency")}
_FIGURES = {"prefill": ("ttft_ms", "tokens_per_s"), "decode": ("itl_ms", "tokens_per_s"),
            "vision": ("latency_ms", "images_per_s"), "kvcache": ("ttft_hit_ms", "ttft_uncached_ms", "gb_s")}


def _cell(median: float, lo: float, hi: float) -> str:
    return f"{median:10.2f} [{lo:.2f}-{hi:.2f}]"



@dataclass(slots=True)
class Measured:
    """One operating point's rounds (warm-up dropped) and their median figures."""

    stage: str
    point: tuple[int, int]
    rounds: list[dict[str, float]]
    held_out: bool = False

    def median(self, name: str) -> float:
        return statistics.median(r[name] for r in self.rounds)

    def spread(self, name: str) -> tuple[float, float]:
        return min(r[name] for r in self.rounds), max(r[name] for r in self.rounds)


@dataclass(slots=True)
class SweepResult:
    profile: Profile
    measured: list[Measured]
    skipped: list[tuple[str, tuple[int, int]]] = field(default_factory=list)
    checks: list[tuple[str, holdout.Check]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


def report_text(result: SweepResult, header: Mapping[str, Any]) -> str:
    lines = [f"model: {result.profile.model}", f"device: {header['device']}"]
    lines += [f"{k}: {v}" for k, v in result.notes.items()]
    lines += ["settings: " + ", ".join(f"{k}={v}" for k, v in sorted(result.profile.settings.items()))]
    for stage, (ax, ay) in _AXES.items():
        if stage in ("vision", "kvcache") and not any(m.stage == stage for m in result.measured):
            continue  # not measured (no vision instance, no prefill /metrics, ...): the notes say so
        lines += ["", f"## {stage}: median [min-max] over the timed rounds (warm-up dropped)",
                  f"{ax:>12} {ay:>11} " + " ".join(f"{n:>28}" for n in _FIGURES[stage]) + "  rounds  held_out"]
        for m in sorted((m for m in result.measured if m.stage == stage), key=lambda m: (m.held_out, m.point)):
            cells = " ".join(f"{_cell(m.median(n), *m.spread(n)):>28}" for n in _FIGURES[stage])
            extra = ""
            if stage == "decode":  # how many rounds had every stream decoding together, at what length
                together = sum(bool(r["overlapped"]) for r in m.rounds)
                longest = max(int(r["max_tokens"]) for r in m.rounds)
                extra = f"  together {together}/{len(m.rounds)}, max_tokens {longest}"
            if stage == "kvcache":  # the cross-check of the bytes against the tokens loaded
                extra = f"  bytes/token {statistics.median(r['bytes_per_token'] for r in m.rounds):.0f}"
            lines.append(f"{m.point[0]:>12} {m.point[1]:>11} {cells}  {len(m.rounds):>6}  "
                         f"{'yes' if m.held_out else '':>8}{extra}")
    skipped = [f"{stage} {p}" for stage, p in result.skipped]
    lines += ["", "skipped by the budget: " + (", ".join(skipped) or "none")]
    if result.checks:
        lines += ["", f"## held out: predicted (log-log interpolation between grid neighbours) against measured; "
                      f"target |error| <= {TARGET_ERROR:.0%}",
                  f"{'stage':>8} {'point':>12} {'figure':>13} {'measured':>10} {'predicted':>10} {'error':>8}"]
        for stage, c in result.checks:
            pred = "-" if c.predicted is None else f"{c.predicted:10.2f}"
            err = "-" if c.error is None else f"{c.error:+.1%}"
            lines.append(f"{stage:>8} {str(c.point):>12} {c.figure:>13} {c.measured:10.2f} {pred:>10} {err:>8}")
        errors = [abs(c.error) for _, c in result.checks if c.error is not None]
        if errors:
            within = sum(e <= TARGET_ERROR for e in errors)
            lines.append(f"within {TARGET_ERROR:.0%}: {within} of {len(errors)} figures; worst {max(errors):.1%}")
    return "\n".join(lines)
