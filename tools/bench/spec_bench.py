"""bench-spec: speculative decoding against none, on one engine setup (issue 13).

For each batch size, the same greedy requests (Python prompts for a model with a
tokenizer, seeded token ids otherwise) run with speculation off, with a fixed γ
for each γ given, and with DSpark's schedule (γ the largest given): throughput
(output tokens per second of the whole batch), per-request tokens per second, and
the mean accepted length (tokens emitted per verification). Every configuration's
tokens must equal the run without speculation (greedy is lossless), or the bench
fails. Each configuration first runs the same requests untimed until it settled (steady
state: the scheduled modes have measured acceptance and costs, and tried the depths they
would try; see _warm_up); then the timed runs of all configurations take turns (see
_bench_batch), "vs none" is each one's throughput over no speculation's, and the table
shows the timed runs' steps by drafting depth and what the drafting steps cost.
Prints a table and writes JSON.

With ``--speculative mtp --replay-accepted 3.5 4.5 5.5``, beside the measured rows: the
scheduler's choices (drafting depth, tokens verified per request, expected tokens per
second) when an acceptance profile of that mean accepted length is replayed on this
model's measured SPS table and MTP drafting cost (tools/bench/spec_replay.py): with
random weights the measured acceptance says nothing of a trained MTP's.

  python -m tools.bench.spec_bench --model models/trained/target \\
      --draft models/trained/draft --batch 1 8 --spec-tokens 2 4 --json out.json
  python -m tools.bench.spec_bench --model v4-released --speculative mtp --batch 1 4 \\
      --spec-tokens 1 3 --replay-accepted 3.5 4.5 5.5 --json out.json
"""

import argparse
import gc
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.setup import sps_profile
from shared.engine.spec.speculator import SCHEDULED, WARMUP_VERIFICATIONS
from tools.bench.raw_file import write_json
from tools.bench.spec_replay import PROFILE_SOURCE, ReplayRow, format_replay, replay, time_mtp_pass
from tools.bench.step_times import StepTimes

MAX_WARMUP_ROUNDS = 8
"""Untimed rounds at most before the timed one (a schedule that never settles is timed as it is)."""

PYTHON_PROMPTS = (
    "def read_config(path):\n    \"\"\"Read a configuration file and return a dict.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n",
    "def parse_args(args):\n    parser = argparse.ArgumentParser()\n    parser.add_argument(",
)


@dataclass
class Row:
    batch: int
    mode: str
    """none, fixed γ=N or dspark γ=N."""
    output_tokens: int
    seconds: float
    tokens_per_s: float
    per_request_tokens_per_s: float
    mean_accepted_length: float
    equal_to_none: bool
    num_verifications: int = 0
    accepted_by_position: list[int] | None = None
    """[k]: verifications whose drafted token k + 1 passed (the survival curve's counts)."""
    steps_by_depth: dict[int, int] | None = None
    """The timed run's decode steps by drafting depth (0: plain); empty without speculation."""
    plain_step_ms: float = 0.0
    """The timed runs' mean step() without drafting (prefill steps included)."""
    drafting_ms_per_run: float = 0.0
    """The timed runs' time in steps that drafted, per run: what the probes and trials cost."""
    vs_none: float = 1.0
    """Throughput over "none"'s, measured interleaved with it."""
    runs_s: list[float] | None = None
    """Each timed run's seconds, in order."""


def _prompts(llm: LLM, batch: int, seed: int) -> list[str | list[int]]:
    if llm.engine.recipe is not None:
        return [PYTHON_PROMPTS[i % len(PYTHON_PROMPTS)] for i in range(batch)]
    rng = random.Random(seed)
    vocab = llm.engine.model.config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(batch)]


def run_spec_bench(
    model: str,
    draft: str | None,
    batches: list[int],
    spec_tokens: list[int],
    max_tokens: int,
    seed: int = 0,
    speculative: str | None = None,
    repeats: int = 3,
) -> list[Row]:
    """speculative: the drafter (ngram, draft or mtp); draft when a draft folder is given, else ngram."""
    speculative = speculative or ("draft" if draft else "ngram")
    modes: list[tuple[str, dict]] = [("none", {})]
    for gamma in spec_tokens:
        modes.append((f"fixed γ={gamma}", dict(speculative=speculative, spec_tokens=gamma, spec_schedule="fixed")))
    for schedule in ("dspark", "capacity"):
        knobs = dict(speculative=speculative, spec_tokens=max(spec_tokens), spec_schedule=schedule)
        modes.append((f"{schedule} γ={max(spec_tokens)}", knobs))
    # A second engine without speculation, timed in turns with the rest: how far two identical
    # engines read apart in this run (an A/A control; on the H200 a ~1.5 ms step at batch 1
    # moved by up to 40 % between runs), against which the scheduled modes' "vs none" is read.
    modes.append(("none (control)", {}))
    if draft and speculative == "draft":
        modes = [(mode, {**knobs, "spec_draft_model": draft} if knobs else knobs) for mode, knobs in modes]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows: list[Row] = []
    for batch in batches:
        rows += _bench_batch(model, modes, batch, seed, params, repeats)
    return rows


def _bench_batch(
    model: str, modes: list[tuple[str, dict]], batch: int, seed: int, params: SamplingParams, repeats: int
) -> list[Row]:
    """Every mode's engine built and warmed first, then the timed runs interleaved: round r
    runs each mode once, in an order rotated by r. The machine drifts (on the H200 two
    identical plain runs a minute apart differed by 27 %); interleaved, the drift falls on
    every mode alike, and each mode's median is read against "none"'s."""
    engines = {mode: LLM(model, max_num_seqs=max(batch, 1), **knobs) for mode, knobs in modes}
    names = list(engines)
    prompts = _prompts(engines["none"], batch, seed)
    for llm in engines.values():
        _warm_up(llm, prompts, params)
    # As a service freezes what it built (shared/runtime/service.py): the collector's full
    # passes would walk every engine's objects, a stall that lands on whichever mode allocates.
    gc.collect()
    gc.freeze()
    before = {m: _depths(llm) for m, llm in engines.items()}
    timers = {m: StepTimes(llm) for m, llm in engines.items()}
    timed: dict[str, list[float]] = {m: [] for m in names}
    tokens: dict[str, list[list[int]]] = {}
    lossless = dict.fromkeys(names, True)
    for r in range(repeats):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            outs = engines[mode].generate(prompts, params)
            timed[mode].append(time.perf_counter() - start)
            got = [o.token_ids for o in outs]
            tokens.setdefault(mode, got)
            lossless[mode] = lossless[mode] and got == tokens["none"] == tokens[mode]
    rows: list[Row] = []
    for mode in names:
        llm, steps = engines[mode], timers[mode]
        steps.detach()
        seconds = statistics.median(timed[mode])
        plain = steps.by_depth.get(0, [])
        n = sum(len(t) for t in tokens[mode])
        load = llm.engine.load()
        rows.append(Row(batch, mode, n, seconds, n / seconds, n / batch / seconds, load.mean_accepted_length,
                        lossless[mode], load.num_spec_verifications, load.spec_accepted_by_position,
                        dict(sorted((_depths(llm) - before[mode]).items())),
                        sum(plain) / len(plain) if plain else 0.0, steps.drafting_ms() / repeats,
                        runs_s=timed[mode]))  # fmt: skip
    for row in rows:
        row.vs_none = row.tokens_per_s / rows[0].tokens_per_s
    # Free the engines before the next batch size: their memory, graphs and objects must
    # not weigh on the rows after them (the collector scans every live object).
    for llm in engines.values():
        llm.engine.close()
    del engines, timers
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def replay_rows(
    model: str, batches: list[int], profiles: list[float], gamma: int, context: int
) -> tuple[list[ReplayRow], list[dict]]:
    """The scheduler's choices under each acceptance profile (spec_replay), per batch
    size, on this model's SPS table and one MTP drafting pass at ``context`` tokens,
    both measured here on an engine with the MTP drafter. Also returns, per batch, the
    costs the choices were made on (the SPS table and the MTP pass's milliseconds)."""
    rows: list[ReplayRow] = []
    costs: list[dict] = []
    for batch in batches:
        llm = LLM(model, max_num_seqs=batch, speculative="mtp", spec_tokens=gamma, spec_schedule="fixed")
        sps = sps_profile(llm.engine.runner.time_step, batch * (1 + gamma))
        drafter = llm.engine.speculator.drafter
        draft_seconds = time_mtp_pass(drafter.layer, batch, context)
        rows += replay(sps, profiles, gamma, batch, draft_seconds)
        costs.append(dict(batch=batch, sps_tokens=list(sps.tokens), sps_steps_per_s=list(sps.steps_per_s),
                          mtp_pass_ms=1e3 * draft_seconds))  # fmt: skip
        llm.engine.close()
    return rows, costs


def _depths(llm: LLM) -> Counter[int]:
    speculator = llm.engine.speculator
    return Counter(speculator.stats.steps_by_depth) if speculator is not None else Counter()


def _warm_up(llm: LLM, prompts: list[str | list[int]], params: SamplingParams) -> None:
    """Run the same work untimed until the speculator settled: the figures are a serving
    engine's steady state, which a deployment reaches once, not per request. Two phases:
    the speculator's own warm-up (WARMUP_VERIFICATIONS verifications, every drafted token
    verified while the confidences are fitted), then the scheduled modes' trials (each
    depth whose modelled rate beats what was measured is tried once at this batch size)
    until two rounds in a row chose the same depth most often."""
    speculator = llm.engine.speculator
    last_mode: int | None = None
    for _ in range(MAX_WARMUP_ROUNDS):
        before = Counter(speculator.stats.steps_by_depth) if speculator is not None else Counter()
        llm.generate(prompts, params)
        if speculator is None or speculator.schedule not in SCHEDULED:
            if speculator is None or speculator.stats.num_verifications >= WARMUP_VERIFICATIONS:
                return
            continue
        if speculator.stats.num_verifications < WARMUP_VERIFICATIONS:
            continue
        steps = Counter(speculator.stats.steps_by_depth) - before
        mode = steps.most_common(1)[0][0] if steps else None
        if mode is not None and mode == last_mode:
            return
        last_mode = mode


def format_table(rows: list[Row]) -> str:
    head = (f"{'batch':>5}  {'mode':<14} {'tok/s':>9} {'vs none':>7} {'tok/s/req':>10} {'accepted':>9}  lossless  "
            f"{'plain ms':>8} {'drafting ms/run':>15}  steps by depth")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.batch:>5}  {r.mode:<14} {r.tokens_per_s:>9.1f} {r.vs_none:>7.2f} {r.per_request_tokens_per_s:>10.1f} "
                     f"{r.mean_accepted_length:>9.2f}  {'yes' if r.equal_to_none else 'NO':<8}  "
                     f"{r.plain_step_ms:>8.3f} {r.drafting_ms_per_run:>15.1f}  "
                     f"{' '.join(f'{d}:{n}' for d, n in (r.steps_by_depth or {}).items())}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spec_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/trained/target")
    p.add_argument("--draft", default=None, help="a draft model folder (speculative=draft); none: prompt lookup")
    p.add_argument("--speculative", choices=("ngram", "draft", "mtp"), default=None,
                   help="the drafter (default: draft with --draft, else ngram); mtp: the model's own MTP layer")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--spec-tokens", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (their median counts)")
    p.add_argument("--replay-accepted", type=float, nargs="+", default=[],
                   help="with --speculative mtp: mean accepted lengths whose scheduler choices to replay (spec_replay)")
    p.add_argument("--replay-gamma", type=int, default=5, help="γ of the replayed profiles (DSpark-5: 5)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.batch) < 1 or min(args.spec_tokens) < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--batch, --spec-tokens, --max-tokens and --repeats take positive integers")
    if args.speculative == "draft" and not args.draft:
        p.error("--speculative draft needs --draft")
    if args.replay_accepted and args.speculative != "mtp":
        p.error("--replay-accepted replays the MTP drafter's costs: it needs --speculative mtp")
    rows = run_spec_bench(args.model, args.draft, args.batch, args.spec_tokens, args.max_tokens, args.seed,
                          args.speculative, args.repeats)  # fmt: skip
    print(format_table(rows))
    replayed: list[ReplayRow] = []
    costs: list[dict] = []
    if args.replay_accepted:
        replayed, costs = replay_rows(args.model, args.batch, args.replay_accepted, args.replay_gamma,
                                      24 + args.max_tokens // 2)  # fmt: skip
        print(f"\nREPLAYED, not measured: the scheduler's choices under an acceptance profile ({PROFILE_SOURCE})")
        print(format_replay(replayed))
        print("on the costs measured for it (SPS: steps per second at B tokens per step; one MTP drafting pass):")
        for c in costs:
            table = " ".join(f"{b}:{r:.1f}" for b, r in zip(c["sps_tokens"], c["sps_steps_per_s"]))
            print(f"  batch {c['batch']}: SPS {table}; MTP pass {c['mtp_pass_ms']:.2f} ms")
    if args.json is not None:
        figures: dict = {"rows": [asdict(r) for r in rows]}
        if replayed:
            figures.update(replay=[asdict(r) for r in replayed], replay_costs=costs, replay_profile_source=PROFILE_SOURCE)
        write_json(args.json, figures)
    if not all(r.equal_to_none for r in rows):
        print("speculation changed the greedy output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
