"""SPS(B) of a model on a device, and what DSpark's schedule would choose on it
(issue 13, point 5). The simulation is labelled as one: it takes the acceptance
by position measured by bench-spec on the trained pair (a fixed-γ row's counts:
ā_j = verifications whose first j drafted tokens passed / verifications) and
applies it to every request of a batch, with drafting taken as free (an MTP head
inside the target's step, DSpark's setting), so it says what the schedule would
pick on this model's steps-per-second curve, not what a run measured.

  python -m tools.bench.sps_sim --model models/llama3-8b --dtype bfloat16 --device cuda \\
      --acceptance spec.json --json sps.json
"""

import argparse
import sys
from pathlib import Path

import torch

from shared.engine.spec.schedule import SpsTable, expected_throughput, schedule_greedy
from shared.engine.spec.setup import sps_profile
from tools.bench.raw_file import read_json, write_json


def measure_sps(model: str, dtype: str, device: str, max_tokens: int) -> SpsTable:
    from shared.engine.llm import LLM

    llm = LLM(model, dtype=dtype, device=device, cuda_graphs=False)
    return sps_profile(llm.engine.runner.time_step, max_tokens)


def mean_survival(rows: list[dict]) -> list[float]:
    """ā_j from the fixed-γ row with the most verifications (its positions all verified)."""
    fixed = [r for r in rows if r["mode"].startswith("fixed") and r.get("num_verifications")]
    if not fixed:
        raise SystemExit("the acceptance JSON has no fixed-γ row with verifications (bench-spec's --json)")
    best = max(fixed, key=lambda r: (int(r["mode"].split("=")[1]), r["num_verifications"]))
    return [a / best["num_verifications"] for a in best["accepted_by_position"]]


def simulate(sps: SpsTable, survival: list[float], batches: list[int]) -> list[dict]:
    out = []
    for r in batches:
        rows = [survival] * r
        none = r * sps(r)
        fixed = {g: expected_throughput([g] * r, rows, sps) for g in range(1, len(survival) + 1)}
        lengths = schedule_greedy(rows, sps)
        out.append(dict(batch=r, none=none, fixed=fixed, dspark=expected_throughput(lengths, rows, sps),
                        dspark_tokens_verified=sum(lengths)))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sps_sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--acceptance", type=Path, required=True, help="bench-spec's JSON")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    _, acceptance = read_json(args.acceptance)
    # bench-spec's raw file: {"header", "rows"}; one from before the header is the bare list.
    survival = mean_survival(acceptance["rows"] if isinstance(acceptance, dict) else acceptance)
    sps = measure_sps(args.model, args.dtype, args.device, args.max_tokens)
    print("SPS(B), steps per second at B tokens per step:")
    for b, s in zip(sps.tokens, sps.steps_per_s):
        print(f"  B={b:>5}  {s:9.1f}  ({b * s:10.0f} tokens/s)")
    print("mean survival by position (measured on the trained pair):", [round(a, 3) for a in survival])
    print("SIMULATION (expected output tokens/s from SPS and mean survival, drafting free):")
    sim = simulate(sps, survival, args.batch)
    gammas = sorted(sim[0]["fixed"])
    print(f"{'batch':>5} {'none':>9} " + " ".join(f"{'γ=' + str(g):>9}" for g in gammas) + f" {'dspark':>9} {'verified':>8}")
    for row in sim:
        fixed = " ".join(f"{row['fixed'][g]:9.0f}" for g in gammas)
        print(f"{row['batch']:>5} {row['none']:9.0f} {fixed} {row['dspark']:9.0f} {row['dspark_tokens_verified']:>8}")
    if args.json is not None:
        write_json(args.json, dict(sps=dict(tokens=sps.tokens, steps_per_s=sps.steps_per_s), survival=survival,
                                   simulation=sim))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
