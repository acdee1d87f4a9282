"""Where tests/gpu/test_gpu_deepseek_v4.py's bf16 error comes from: the tiny seeded V4
checkpoint's greedy decode in bfloat16, each chosen token's logprob against
transformers' float32 (the truth), with our kernels as chosen ("auto": Triton, the
fused MoE) and with PyTorch's ("torch"), beside transformers' own bf16 error on the
same tokens. The test asks ours <= 2x transformers' mean per prompt and <= 1.25x over
all prompts pooled; this prints the two means per prompt, then pooled, per kernel table, so that a kernel that rounds worse
than the reference path shows as a gap between the two tables' rows.

  python -m tools.bench.v4_bf16_error --variant mixed        # on the device machine
"""

import argparse
import sys
import tempfile

import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.deepseek_v4_models import save_tiny_v4, seeded_prompts as prompts
from tools.bench.raw_file import add_json_flag, write_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="v4_bf16_error", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="mixed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", nargs="+", default=["auto", "torch"],
                   help="kernel tables to compare (\"triton\" on the CPU under TRITON_INTERPRET=1)")
    add_json_flag(p)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    path = save_tiny_v4(args.variant, tempfile.mkdtemp(), seed=args.seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    print(f"# variant {args.variant} seed {args.seed}: mean |logprob - float32's| of the chosen tokens, per prompt")
    rows: list[dict] = []
    for kernels in args.kernels:
        llm = LLM(str(path), dtype="bfloat16", device=args.device, block_size=16, prefill_chunk_size=32, kernels=kernels)
        ours_all, hf_all = [], []
        for p_ids, out in zip(prompts(), llm.generate(prompts(), params)):
            seq = torch.tensor([p_ids + out.token_ids], device=args.device)
            chosen = torch.tensor(out.token_ids, device=args.device)[:, None]
            with torch.inference_mode():
                theirs = torch.log_softmax(hf(seq).logits[0, len(p_ids) - 1 : -1].float(), -1).gather(1, chosen)[:, 0]
                truth = torch.log_softmax(hf32(seq).logits[0, len(p_ids) - 1 : -1].float(), -1).gather(1, chosen)[:, 0]
            ours = torch.tensor([lp.logprob for lp in out.logprobs], device=args.device)
            ours_err, hf_err = (ours - truth).abs(), (theirs - truth).abs()
            print(f"kernels={kernels:<5} prompt {len(p_ids):>3}: ours mean {ours_err.mean():.4f} max {ours_err.max():.4f}"
                  f"  transformers bf16 mean {hf_err.mean():.4f} max {hf_err.max():.4f}"
                  f"  ratio {ours_err.mean() / hf_err.mean():.2f}")
            rows.append({"kernels": kernels, "prompt_len": len(p_ids), "ours_mean": float(ours_err.mean()),
                         "ours_max": float(ours_err.max()), "transformers_bf16_mean": float(hf_err.mean()),
                         "transformers_bf16_max": float(hf_err.max())})  # fmt: skip
            ours_all.append(ours_err)
            hf_all.append(hf_err)
        ours_mean, hf_mean = torch.cat(ours_all).mean(), torch.cat(hf_all).mean()
        print(f"kernels={kernels:<5} all prompts: ours mean {ours_mean:.4f}  transformers bf16 mean {hf_mean:.4f}"
              f"  ratio {ours_mean / hf_mean:.2f}")
        if hasattr(llm, "close"):
            llm.close()
        del llm
        torch.cuda.empty_cache()
    write_rows(args.json, rows, variant=args.variant, seed=args.seed, max_tokens=args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
