"""One request that slows everyone (issue 32, point 5): a batch's output tokens per second
with one structured-output, penalties or logprobs request in it, against the same batch
without (every request plain, greedy).

Each variant is the same batch of --batch greedy requests (ignore_eos, --tokens tokens
each) in which one request is replaced by its kind: "structured" (a regex grammar the
compiler has cached, longer than any output: it never completes), "structured, new
grammar" (one never seen: its compile runs in the timed batch), "penalties" (repetition, presence and frequency), "logprobs" (top 5). Each engine
(synchronous steps; async scheduling; optionally n-gram speculation) runs every variant
once per round, the order rotated round by round, after a warm-up round; the figure is
the median tokens/s over --rounds with its min-max spread, the ratio of medians to the
plain batch's, and the ratio of the best rounds (on a shared machine, the round least
disturbed by others). --variant picks some (plain is always run); each engine's steps
are printed by how they ran (EngineLoad.steps: a request that turns overlap off shows as
synchronous steps), and the load average before and after (a shared machine's load).

    python -m tools.bench.raw_file --out docs/perf/one_request_cpu.txt -- \\
        python -m tools.bench.one_request_bench --device cpu
"""

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable

import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured.spec import StructuredSpec
from tools.bench.raw_file import add_json_flag, write_rows

_fresh = itertools.count()


def _structured(tokens: int) -> SamplingParams:
    # Longer than any output of --tokens tokens: the grammar never completes, so the request
    # decodes its max_tokens as the plain ones do (no ignore_eos: EOS stays the grammar's).
    return SamplingParams(max_tokens=tokens, temperature=0.0, structured=StructuredSpec("regex", "[a-z_ ]{4000}"))


def _new_grammar(tokens: int) -> SamplingParams:
    """A grammar the compiler has not seen: its compile falls in the timed run."""
    spec = StructuredSpec("regex", f"field_{next(_fresh)}: [a-z_ ]{{4000}}")
    return SamplingParams(max_tokens=tokens, temperature=0.0, structured=spec)


VARIANTS: dict[str, Callable[[int], SamplingParams | None]] = {
    "plain": lambda tokens: None,
    "structured": _structured,
    "structured, new grammar": _new_grammar,
    "penalties": lambda tokens: SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                               repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
    "logprobs": lambda tokens: SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5),
}  # fmt: skip


def _run(llm: LLM, batch: int, tokens: int, odd: SamplingParams | None, device: str) -> float:
    """Output tokens per second of one batch (the odd request, if any, is the last)."""
    plain = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (7 * i + j) % 300 for i in range(24)] for j in range(batch)]
    params = [plain] * (batch - 1) + [odd or plain]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/trained/target")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: the engine's own)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--speculative", action="store_true", help="also an engine with n-gram speculation")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS),
                        help="run this variant (repeat for more; default all; plain is always run)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    names = ["plain", *(n for n in args.variant or VARIANTS if n != "plain")]
    engines = {"sync steps": {"async_scheduling": False}, "async scheduling": {"async_scheduling": True}}
    if args.speculative:
        engines["ngram speculation"] = {"async_scheduling": True, "speculative": "ngram", "spec_tokens": 4}
    print(f"batch {args.batch} greedy requests x {args.tokens} tokens, {args.rounds} rounds after a warm-up, "
          f"variant order rotated per round; tokens/s median [min-max], ratio of medians and of bests to plain")  # fmt: skip
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows: list[dict] = []
    for engine_name, settings in engines.items():
        dtype = {"dtype": args.dtype} if args.dtype else {}
        llm = LLM(args.model, device=args.device, **dtype, **settings)
        for name in names:  # warm-up: first steps, the cached grammar compiled
            _run(llm, args.batch, args.tokens, VARIANTS[name](args.tokens), args.device)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rates[name].append(_run(llm, args.batch, args.tokens, VARIANTS[name](args.tokens), args.device))
        base = statistics.median(rates["plain"])
        print(f"{engine_name}:")
        best = max(rates["plain"])
        for name in names:
            med = statistics.median(rates[name])
            print(f"  {name:<24} {med:8.1f} tok/s  [{min(rates[name]):7.1f}-{max(rates[name]):7.1f}]  "
                  f"ratio {med / base:5.3f}  best-of ratio {max(rates[name]) / best:5.3f}", flush=True)  # fmt: skip
            rows.append({"engine": engine_name, "variant": name, "median_tok_s": med, "tok_s_per_round": rates[name],
                         "ratio": med / base, "best_of_ratio": max(rates[name]) / best})  # fmt: skip
        load = llm.engine.load()
        steps = load.steps
        print(f"  steps (all runs): {steps.overlapped} overlapped, of which {steps.sampled_after_read_back} "
              f"sampled after the read-back; {steps.synchronous} synchronous")  # fmt: skip
        if load.spec_fallbacks:
            print(f"  speculation fallbacks: {dict(load.spec_fallbacks)}")
        llm.engine.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    write_rows(args.json, rows, batch=args.batch, tokens=args.tokens, rounds=args.rounds)


if __name__ == "__main__":
    main()
