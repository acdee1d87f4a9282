"""What a speculating engine's plain steps cost against a plain engine's (issue 13).

The scheduled modes choose depth 0 on most steps where drafting does not pay, and should
then decode as fast as an engine without speculation. This times 128-token greedy runs,
per step, side by side (best of 3 rounds, interleaved): a plain engine; a dspark engine
as it schedules (mostly plain steps, and its probes); the same engine held at depth 0
(no probes); and that engine with its speculator detached, i.e. its runner as built for
speculation (graph buckets, the draft model's memory) but no speculator calls. The
second against the third is what the probes cost; the third against the fourth, the
speculator's per-step cost; the fourth against the first, the runner's.

    python -m tools.bench.spec_plain_steps --device cuda --batch 1 64
"""

import argparse
import time

import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tools.bench.raw_file import add_json_flag, write_rows
from tools.bench.step_times import StepTimes

STEPS = 128


def _ms_per_step(llm: LLM, batch: int, device: str) -> float:
    prompts = [[5 + (7 * i + j) % 300 for i in range(20)] for j in range(batch)]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm: graphs captured, costs measured
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / STEPS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/trained/target")
    parser.add_argument("--draft", default="models/trained/draft")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    settings = {"device": args.device, "async_scheduling": True}
    if args.dtype:
        settings["dtype"] = args.dtype
    plain = LLM(args.model, **settings)
    spec = LLM(args.model, **settings, speculative="draft", spec_draft_model=args.draft, spec_tokens=6,
               spec_schedule="dspark")  # fmt: skip
    speculator = spec.engine.speculator
    assert speculator is not None
    schedules = speculator._choose_depth  # noqa: SLF001

    def held(num_requests: int) -> int:  # depth 0: plain steps only
        return 0

    rows: list[dict] = []
    for batch in args.batch:
        times: dict[str, list[float]] = {
            "plain engine": [], "dspark as it schedules": [], "dspark at depth 0": [], "its speculator detached": [],
        }  # fmt: skip
        drafting = {"dspark as it schedules": 0, "dspark at depth 0": 0}
        as_scheduled: list[str] = []

        def drafted() -> int:
            return sum(n for depth, n in speculator.stats.steps_by_depth.items() if depth)

        for _ in range(args.rounds):
            times["plain engine"].append(_ms_per_step(plain, batch, args.device))
            spec.engine.speculator, speculator._choose_depth = speculator, schedules  # noqa: SLF001
            before = drafted()
            timer = StepTimes(spec)
            times["dspark as it schedules"].append(_ms_per_step(spec, batch, args.device))
            timer.detach()
            as_scheduled.append(timer.report())
            speculator._choose_depth = held  # noqa: SLF001
            drafting["dspark as it schedules"] += drafted() - before
            before = drafted()
            times["dspark at depth 0"].append(_ms_per_step(spec, batch, args.device))
            drafting["dspark at depth 0"] += drafted() - before
            spec.engine.speculator = None
            times["its speculator detached"].append(_ms_per_step(spec, batch, args.device))
        spec.engine.speculator, speculator._choose_depth = speculator, schedules  # noqa: SLF001
        print(f"batch {batch}, ms per step (best of {args.rounds}; all):")
        for name, values in times.items():
            print(f"  {name:<24} {min(values):7.3f}   ({', '.join(f'{v:.3f}' for v in values)})", flush=True)
            rows.append({"batch": batch, "engine": name, "best_ms_per_step": min(values), "ms_per_step": values,
                         "drafting_steps": drafting.get(name)})  # fmt: skip
        print("  drafting steps: " + ", ".join(f"{name} {n}" for name, n in drafting.items()))
        for r, line in enumerate(as_scheduled):
            print(f"  dspark as it schedules, round {r + 1} (warm-up and timed run), step() times: {line}")
    graphs = plain.engine.runner.graphs, spec.engine.runner.graphs
    print("graph buckets: plain", graphs[0].buckets if graphs[0] else None, "/ speculating",
          graphs[1].buckets if graphs[1] else None)
    write_rows(args.json, rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
