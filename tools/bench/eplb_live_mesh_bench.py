"""Live EPLB through the mesh (issue 28, point 5), as a user gets it: the inter-token
latency (ITL) of HTTP-streamed completions while EPLB moves experts, against that
outside a move. The in-engine figure is tools/bench/eplb_live_bench.py; this one adds
the mesh's whole path (balancer, NATS, prefill's KV handoff, SSE).

    python -m tools.bench.eplb_live_mesh_bench --rounds 5 --out docs/perf/eplb_live_mesh_cpu_<date>.txt

Targets, each a mesh started once and kept (`up`'s parallel_env: prefill and decode
instances each over RANKS gloo ranks with expert parallelism): ``off`` (no EPLB),
``background`` (EPLB, moves beside the steps: the default) and ``blocking`` (EPLB
with ``blocking_moves``). A run keeps CONCURRENCY greedy streams going over HTTP (a
closed loop: each that ends is replaced) until REQUESTS have run. A token's arrival is
when its SSE chunk reached the client; its ITL is the gap since the request's
previous token. When experts moved is read from the decode instance's log, which
lines each move's start and switch (shared/engine/executor/move_schedule.py) as the
step message that starts or switches it is made, right as that step begins. A gap is
*during a rebalance* when the step that ended it began during a move: its start
(the previous token's arrival, within TOLERANCE_S) lies between a move's start and
its switch, both ends included, so the start step, the steps beside the move and the
switch step count, as the in-engine bench counts them (a blocking move is an instant
that marks its own step); else *outside*. A gap is placed by where it starts, not by
whether it overlaps a move: overlapping would class the long gaps (a stall of the
shared machine) as during more often than the short ones, whatever the moves cost.
Per round and target: p99 during / p99 outside, and the failed requests (an
error, or fewer tokens than asked). Every mesh is warmed with one dropped run; the
targets take turns, round r starting at target r mod 3 (tools/bench/rounds.py);
ratios are per round, then their median and min-max. The machine's load average is
printed with each round: on a shared CPU it is most of the noise.

Clock: the log's timestamps (milliseconds, local time) and the client's time.time()
are the same host's clock. A step begins as the previous one's tokens leave for the
client (NATS, the balancer, HTTP: milliseconds), against steps of tens to hundreds of
milliseconds; each run prints how far each move's start is from the nearest arrival
(the median and the largest), which says whether TOLERANCE_S holds."""

import argparse
import datetime
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from tools.bench.eplb_live_bench import EPLB, RANKS, p99, spread
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows
from tools.bench.rounds import rotation
from tools.launch.up import Mesh, free_port, parallel_env
from tools.make_model import make_model

TARGETS = ("off", "background", "blocking")
CONCURRENCY = 8
REQUESTS = 24
"""Requests per run (CONCURRENCY at a time)."""
PROMPT_TOKENS = 24
TOLERANCE_S = 0.02
"""How far a step's first moment (its order, logged) may be from the client's arrival of
the previous step's tokens: the trip to the client minus the engine's turn between steps."""
MAX_TOKENS = 48
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+ shared\.engine\.executor\.move_schedule: "
                       r"EPLB: layer (\d+) (moving, in the background|switched on every rank|moving and switched)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Move:
    """One layer's move as the decode log says: from the step message that started it to
    the one that switched it (unix seconds; equal for a blocking move)."""

    layer: int
    start: float
    end: float


def moves_in_log(text: str) -> list[Move]:
    """The moves the instance's log lines (one in flight at a time: a switch ends the
    move started last; one never switched is in flight until the end of time)."""
    moves: list[Move] = []
    started: tuple[int, float] | None = None
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m is None:
            continue
        when = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logging writes
        layer, what = int(m[2]), m[3]
        if what.startswith("moving and switched"):
            moves.append(Move(layer, when, when))
        elif what.startswith("moving"):
            started = (layer, when)
        elif started is not None and started[0] == layer:
            moves.append(Move(layer, started[1], when))
            started = None
    if started is not None:
        moves.append(Move(started[0], started[1], float("inf")))
    return moves


def split_gaps(
    arrivals: Sequence[Sequence[float]], moves: Sequence[Move], tolerance_s: float = TOLERANCE_S
) -> tuple[list[float], list[float]]:
    """Each request's gaps between token arrivals (ms), during a move (the gap began
    between a move's start and its switch, within tolerance_s) or outside one."""
    during: list[float] = []
    outside: list[float] = []
    for times in arrivals:
        for prev, now in zip(times, times[1:]):
            moving = any(move.start - tolerance_s <= prev <= move.end + tolerance_s for move in moves)
            (during if moving else outside).append((now - prev) * 1000)
    return during, outside


def start_offsets_ms(arrivals: Sequence[Sequence[float]], moves: Sequence[Move]) -> list[float]:
    """Per move, how far its start (logged as its first step began) is from the nearest
    token arrival (ms): the classing's error, to set against TOLERANCE_S."""
    every = np.sort(np.concatenate([np.asarray(t, dtype=np.float64) for t in arrivals if t] or [np.zeros(0)]))
    if every.size == 0:
        return []
    offsets = []
    for move in moves:
        i = int(np.searchsorted(every, move.start))
        near = [abs(every[j] - move.start) for j in (i - 1, i) if 0 <= j < every.size]
        offsets.append(min(near) * 1000)
    return offsets


@dataclass(frozen=True, slots=True)
class RunResult:
    during_ms: list[float]
    outside_ms: list[float]
    failed: int
    moves: int
    errors: list[str]
    start_offsets_ms: list[float]


def _env(target: str) -> dict[str, str]:
    eplb = None if target == "off" else json.dumps({**EPLB, "blocking_moves": target == "blocking"})
    return {**parallel_env(RANKS, True, target != "off", eplb), "INFERMESH_ENGINE__MAX_NUM_SEQS": str(CONCURRENCY)}


def _stream(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """One greedy streamed completion: each token's arrival (unix seconds)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    arrivals: list[float] = []
    with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            ids = chunk["choices"][0].get("token_ids") if chunk["choices"] else None
            if ids:
                arrivals += [time.time()] * len(ids)  # tokens of one chunk arrive together
    return arrivals


def run(mesh: Mesh, model: str, seed: int, requests: int = REQUESTS, max_tokens: int = MAX_TOKENS) -> RunResult:
    """One closed-loop run of `requests` streams, CONCURRENCY at a time."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 4000, PROMPT_TOKENS).tolist() for _ in range(requests)]
    url = mesh.api_url + "/completions"
    arrivals: list[list[float]] = []
    errors: list[str] = []
    next_request = iter(range(requests))
    lock = threading.Lock()

    def loop() -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                with lock:
                    i = next(next_request, None)
                if i is None:
                    return
                try:
                    times = _stream(client, url, model, prompts[i], max_tokens)
                except Exception as exc:  # noqa: BLE001  (counted as failed)
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    arrivals.append(times)

    began = time.time()
    threads = [threading.Thread(target=loop) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended = time.time()
    time.sleep(0.3)  # the decode log's last lines (line-buffered stderr: written as logged)
    moves = moves_in_log((mesh.state_dir / "logs" / "decode-0.log").read_text())
    moves = [m for m in moves if m.start < ended and m.end > began]
    during, outside = split_gaps(arrivals, moves)
    failed = len(errors) + sum(len(times) != max_tokens for times in arrivals)
    # A move left in flight by the run before switches with this run's first step: its
    # start is no step of this run's to check the tolerance against.
    offsets = start_offsets_ms(arrivals, [m for m in moves if m.start >= began])
    return RunResult(during, outside, failed, len(moves), errors, offsets)


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (at least 3)")
    parser.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="streams per run")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="new tokens per stream")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    rows: list[dict] = []
    if args.rounds < 3:
        parser.error("at least 3 timed rounds")
    with tee_stdout(args.out), tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "qwen3_moe")
        make_model(model, arch="qwen3_moe", preset="tiny", seed=0)
        print(f"Qwen3-MoE tiny preset (3 MoE layers of 8 experts, hidden 256); a mesh per target: 1 prefill and "
              f"1 decode instance, each EP={RANKS} gloo ranks on the CPU, nats-server, kvcache, the balancer; "
              f"{CONCURRENCY} concurrent greedy HTTP streams, {args.requests} a run, {PROMPT_TOKENS} prompt + "
              f"{args.max_tokens} new tokens; EPLB {EPLB}; {os.cpu_count()} CPUs, {load_average()} at the start")  # fmt: skip
        meshes: dict[str, Mesh] = {}
        try:
            for target in TARGETS:
                mesh = Mesh(model, port=free_port(), state_dir=Path(tmp) / target, extra_env=_env(target))
                meshes[target] = mesh
                mesh.start(timeout_s=300)
            name = httpx.get(meshes["off"].api_url + "/models", timeout=30).json()["data"][0]["id"]
            for target in TARGETS:
                run(meshes[target], name, 999, args.requests, args.max_tokens)  # warm-up, dropped
            ratios: dict[str, list[float]] = {"background": [], "blocking": []}
            vs_off: dict[str, list[float]] = {"background": [], "blocking": []}
            failed = dict.fromkeys(TARGETS, 0)
            for r in range(args.rounds):
                order = rotation(TARGETS, r)
                results = {target: run(meshes[target], name, r, args.requests, args.max_tokens) for target in order}
                off = results["off"]
                off_p99 = p99(off.outside_ms)
                line = [f"round {r} (order {','.join(order)}; {load_average()}): off p99 {off_p99:.2f} ms "
                        f"({len(off.outside_ms)} gaps)"]  # fmt: skip
                for target in TARGETS:
                    failed[target] += results[target].failed
                for target in ("background", "blocking"):
                    res = results[target]
                    during, outside = p99(res.during_ms), p99(res.outside_ms)
                    ratios[target].append(during / outside)
                    vs_off[target].append(p99(res.during_ms + res.outside_ms) / off_p99)
                    rows.append({"round": r, "target": target, "p99_during_ms": during, "p99_outside_ms": outside,
                                 "during_over_outside": during / outside, "whole_over_off": vs_off[target][-1],
                                 "layer_moves": res.moves, "failed": res.failed})  # fmt: skip
                    offsets = res.start_offsets_ms  # none where no move started within the run (a short one)
                    line.append(f"{target}: p99 during {during:.2f} ms ({len(res.during_ms)} gaps) / outside "
                                f"{outside:.2f} ms ({len(res.outside_ms)}) = {during / outside:.3f}; "
                                f"{res.moves} layer moves (start to nearest arrival: " + (
                                    f"median {np.median(offsets):.1f} ms, max {max(offsets):.1f})" if offsets
                                    else "no move started in the run)"))  # fmt: skip
                print("; ".join(line), flush=True)
                for target, res in results.items():
                    for error in res.errors[:3]:
                        print(f"  {target} error: {error}")
            print()
            for target in ("background", "blocking"):
                print(f"{target}: p99 ITL during a rebalance / outside one = {spread(ratios[target])} over "
                      f"{args.rounds} rounds; p99 ITL of the whole run / EPLB off = {spread(vs_off[target])}")
            print(f"failed requests: {failed} of {args.requests * args.rounds} a target; {load_average()} at the end")
            write_rows(args.json, rows, failed=failed, requests_per_target=args.requests * args.rounds)
        finally:
            for mesh in meshes.values():
                mesh.stop()


if __name__ == "__main__":
    main()
