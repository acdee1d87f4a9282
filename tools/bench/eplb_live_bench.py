"""Live EPLB under load (issue 28, point 5): an expert-parallel engine over 2 gloo
ranks on the CPU keeps CONCURRENCY greedy requests running (a closed loop: each one
that ends is replaced) while EPLB rebalances every few steps, and the inter-token
latency (ITL) of the steps during a rebalance is set against that of the steps
outside one.

    python -m tools.bench.eplb_live_bench --rounds 5 --out docs/perf/eplb_live_cpu_<date>.txt

The same through the whole mesh, as a client's HTTP stream sees it:
tools/bench/eplb_live_mesh_bench.py.

Targets, each its own engine built once and kept: ``off`` (EP without EPLB),
``background`` (EPLB, moves beside the steps: the default) and ``blocking`` (EPLB with
``blocking_moves``: each move on the step's path, as before). A token's arrival is
the end of the engine step that delivered it; its ITL is the gap since the request's
previous token. That gap is *during a rebalance* when any step inside it started,
switched or ran beside a move (executor.moves.moving), else *outside*. Per round and
target: p99 during / p99 outside, and the failed requests (an exception, or fewer
tokens than asked). Every engine is warmed with one dropped run; the targets take
turns, round r starting at target r mod 3 (tools/bench/rounds.py's rules); ratios
are per round, then their median and min-max.
"""

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows
from tools.make_model import make_model

TARGETS = ("off", "background", "blocking")
RANKS = 2
CONCURRENCY = 8
REQUESTS = 16
"""Requests per run (CONCURRENCY at a time)."""
PROMPT_TOKENS = 24
MAX_TOKENS = 48
EPLB = {"window_size": 16, "step_interval": 12, "num_redundant_experts": 2}
"""A placement every 12 steps: several rebalances (each moving up to every MoE layer) per run."""


@dataclass(frozen=True, slots=True)
class RunResult:
    during_ms: list[float]
    outside_ms: list[float]
    failed: int
    steps: int
    moving_steps: int
    switches: int


def build(model: str, target: str) -> LLMEngine:
    eplb = {} if target == "off" else dict(enable_eplb=True, eplb_config=json.dumps({
        **EPLB, "blocking_moves": target == "blocking"}))  # fmt: skip
    return LLMEngine(EngineConfig(model=model, tensor_parallel_size=RANKS, enable_expert_parallel=True,
                                  max_num_seqs=CONCURRENCY, **eplb))  # type: ignore[arg-type]  # fmt: skip


def run(engine: LLMEngine, seed: int, requests: int = REQUESTS, max_tokens: int = MAX_TOKENS) -> RunResult:
    """One closed-loop run of `requests` requests, CONCURRENCY at a time."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    moves = getattr(engine.executor, "moves")
    switches_before = moves.num_switches
    arrivals: dict[str, list[int]] = {}  # request -> the step index of each token
    step_ends: list[float] = []
    step_moving: list[bool] = []
    failed = 0
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        rid = f"s{seed}-r{submitted}"
        prompt = rng.integers(10, 4000, PROMPT_TOKENS).tolist()
        engine.add_request(EngineRequest(rid, prompt, params))
        arrivals[rid] = []
        submitted += 1

    for _ in range(min(CONCURRENCY, requests)):
        submit()
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except Exception:  # a failed step fails every request in it: counted, the run ends
            return RunResult([], [], requests, len(step_ends), sum(step_moving), 0)
        step_ends.append(time.perf_counter())
        step_moving.append(moves.moving)
        index = len(step_ends) - 1
        for out in outputs:
            arrivals[out.request_id].extend([index] * len(out.new_token_ids))
            if out.finished:
                failed += len(arrivals[out.request_id]) != max_tokens
                if submitted < requests:
                    submit()
    during, outside = [], []
    for steps in arrivals.values():
        for prev, now in zip(steps, steps[1:]):
            gap_ms = (step_ends[now] - step_ends[prev]) * 1000
            (during if any(step_moving[prev + 1 : now + 1]) else outside).append(gap_ms)
    return RunResult(during, outside, failed, len(step_ends), sum(step_moving), moves.num_switches - switches_before)


def p99(values: Sequence[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (at least 3)")
    parser.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="new tokens per request")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    rows: list[dict] = []
    if args.rounds < 3:
        parser.error("at least 3 timed rounds")
    with tee_stdout(args.out), tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "qwen3_moe")
        make_model(model, arch="qwen3_moe", preset="tiny", seed=0, tokenizer=False)
        print(f"Qwen3-MoE tiny preset (3 MoE layers of 8 experts, hidden 256), EP={RANKS} gloo ranks on the CPU; "
              f"{CONCURRENCY} concurrent greedy requests, {args.requests} a run, {PROMPT_TOKENS} prompt + {args.max_tokens} "
              f"new tokens; EPLB {EPLB}")  # fmt: skip
        engines = {target: build(model, target) for target in TARGETS}
        try:
            for target in TARGETS:
                run(engines[target], 999, args.requests, args.max_tokens)  # warm-up, dropped
            ratios: dict[str, list[float]] = {"background": [], "blocking": []}
            vs_off: dict[str, list[float]] = {"background": [], "blocking": []}
            failed = dict.fromkeys(TARGETS, 0)
            for r in range(args.rounds):
                order = TARGETS[r % 3 :] + TARGETS[: r % 3]
                results = {target: run(engines[target], r, args.requests, args.max_tokens) for target in order}
                off = results["off"]
                off_p99 = p99(off.outside_ms)
                line = [f"round {r} (order {','.join(order)}): off p99 {off_p99:.2f} ms, {off.steps} steps"]
                for target in TARGETS:
                    failed[target] += results[target].failed
                for target in ("background", "blocking"):
                    res = results[target]
                    during, outside = p99(res.during_ms), p99(res.outside_ms)
                    ratios[target].append(during / outside)
                    vs_off[target].append(p99(res.during_ms + res.outside_ms) / off_p99)
                    rows.append({"round": r, "target": target, "p99_during_ms": during, "p99_outside_ms": outside,
                                 "during_over_outside": during / outside, "whole_over_off": vs_off[target][-1],
                                 "failed": res.failed})  # fmt: skip
                    line.append(f"{target}: p99 during {during:.2f} ms ({len(res.during_ms)} gaps) / outside "
                                f"{outside:.2f} ms ({len(res.outside_ms)}) = {during / outside:.3f}; "
                                f"{res.moving_steps}/{res.steps} steps moving, {res.switches} layer switches")  # fmt: skip
                print("; ".join(line))
            print()
            for target in ("background", "blocking"):
                print(f"{target}: p99 ITL during a rebalance / outside one = {spread(ratios[target])} over "
                      f"{args.rounds} rounds; p99 ITL of the whole run / EPLB off = {spread(vs_off[target])}")
            print(f"failed requests: {failed} of {args.requests * args.rounds} a target")
            write_rows(args.json, rows, failed=failed, requests_per_target=args.requests * args.rounds)
        finally:
            for engine in engines.values():
                engine.close()


if __name__ == "__main__":
    main()
