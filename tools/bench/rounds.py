"""bench-mesh's schedule and arithmetic, as pure functions so that tests can check
them exactly (tests/unit/test_bench_rounds.py), apart from any timing.

Why each rule (a review found the H200 mesh table flattered by its baseline):
- every target is warmed at each level (its concurrency, the run's prompt length)
  before it is timed there: a batch size or prompt shape seen for the first time
  pays for allocation, lazy init and new kernels' compiles;
- the first round of each level is run and dropped, whatever the warm-up missed;
- the targets take turns, round r starting at target r mod n, so a burst of load
  from elsewhere on the machine, or a drift through the run, falls on each in turn;
- at least 3 timed rounds, each summarised alone: a figure is the median of its
  rounds and shows their spread (min-max), so a reader sees the noise;
- the headline is the mesh against the engine behind HTTP (the same engine and the
  same OpenAI layer in one process: the strongest baseline, and steadier between runs
  than the in-process engine). Ratios are taken per round, between targets that ran
  side by side, then their median and spread are reported: never a ratio of medians
  taken at different times, never the in-process engine as the denominator.
"""

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DROPPED_ROUNDS = 1
MIN_TIMED_ROUNDS = 3
HEADLINE = ("mesh", "http")
"""Numerator and denominator of the headline ratio."""
METRICS = ("req_s", "out_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "e2e_p50_ms")
_WARMUP_SEED = 1_000_003  # warm-up prompts never share a block with measured ones

Row = Mapping[str, Any]
"""One target's summary of one run (mesh_bench.summarize)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One closed-loop run of one target."""

    level: int
    """Index of the concurrency level."""
    concurrency: int
    target: str
    round: int | None
    """None: the target's warm-up at this level."""
    num_requests: int
    seed: tuple[int, int]
    """Of its prompts: the same for every target of a round, distinct between rounds and levels."""
    timed: bool
    """Counted in the figures: not a warm-up, not a dropped round."""


def rotation(targets: Sequence[str], r: int) -> list[str]:
    """The order of round r: starting at target r mod n."""
    k = r % len(targets)
    return [*targets[k:], *targets[:k]]


def plan(
    targets: Sequence[str], concurrency: Sequence[int], num_requests: Sequence[int], timed_rounds: int
) -> list[Run]:
    """Every run of a bench, in order: per level, each target's warm-up, then
    DROPPED_ROUNDS + timed_rounds rounds of every target in rotation."""
    if timed_rounds < MIN_TIMED_ROUNDS:
        raise ValueError(f"at least {MIN_TIMED_ROUNDS} timed rounds are needed (a median and a spread), got {timed_rounds}")
    if len(concurrency) != len(num_requests):
        raise ValueError("one request count per concurrency level")
    runs = []
    for level, (conc, num) in enumerate(zip(concurrency, num_requests)):
        # Enough requests to fill the level's concurrency once (at least two: a second
        # request meets what the first left behind).
        warm = max(conc, 2)
        runs += [Run(level, conc, t, None, warm, (level, _WARMUP_SEED), False) for t in targets]
        for r in range(DROPPED_ROUNDS + timed_rounds):
            runs += [Run(level, conc, t, r, num, (level, r), r >= DROPPED_ROUNDS) for t in rotation(targets, r)]
    return runs


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed_rounds(results: Sequence[tuple[Run, Row]]) -> list[dict[str, Row]]:
    """The timed rounds of one level, in order, each {target: row}; warm-ups and
    dropped rounds left out."""
    rounds: dict[int, dict[str, Row]] = {}
    for run, row in results:
        if run.timed:
            assert run.round is not None
            rounds.setdefault(run.round, {})[run.target] = row
    return [rounds[r] for r in sorted(rounds)]


def dropped_rounds(results: Sequence[tuple[Run, Row]]) -> list[dict[str, Row]]:
    rounds: dict[int, dict[str, Row]] = {}
    for run, row in results:
        if run.round is not None and not run.timed:
            rounds.setdefault(run.round, {})[run.target] = row
    return [rounds[r] for r in sorted(rounds)]


def target_spreads(rounds: Sequence[Mapping[str, Row]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per target and metric, the median and min-max over the rounds."""
    targets = [t for t in rounds[0]] if rounds else []
    return {t: {m: spread([r[t][m] for r in rounds]) for m in METRICS} for t in targets}


def pair(a: Row, b: Row) -> dict[str, float]:
    """a against b in one round: ratios and differences (ms) of their p50s."""
    return {
        "tok_s_ratio": a["out_tok_s"] / b["out_tok_s"],
        "ttft_ratio": a["ttft_p50_ms"] / b["ttft_p50_ms"],
        "added_ms_per_request": a["ttft_p50_ms"] - b["ttft_p50_ms"],
        "added_ms_per_token": a["tpot_p50_ms"] - b["tpot_p50_ms"],
    }


def paired(rounds: Sequence[Mapping[str, Row]], a: str, b: str) -> dict[str, Any] | None:
    """a against b, round by round, then the median and min-max of each figure;
    None where either target did not run."""
    if not rounds or any(a not in r or b not in r for r in rounds):
        return None
    per_round = [pair(r[a], r[b]) for r in rounds]
    return {"per_round": per_round, **{k: spread([p[k] for p in per_round]) for k in per_round[0]}}


def headline(rounds: Sequence[Mapping[str, Row]]) -> dict[str, Any] | None:
    """The mesh against the engine behind HTTP; None where either did not run (the
    in-process engine never stands in for the baseline)."""
    return paired(rounds, *HEADLINE)


def level_figures(results: Sequence[tuple[Run, Row]]) -> dict[str, Any]:
    """One level's figures from its runs, in the order they ran."""
    rounds = timed_rounds(results)
    return {
        "concurrency": results[0][0].concurrency,
        "headline": headline(rounds),
        "rows": target_spreads(rounds),
        # The OpenAI layer's own cost (http - engine, ms): a difference, never a ratio's denominator.
        "http_layer": paired(rounds, "http", "engine"),
        "rounds": rounds,
        "dropped_rounds": dropped_rounds(results),
    }
