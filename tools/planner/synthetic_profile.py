"""A synthetic stage profile, for the planner's tests and the replay simulator until a
measured one (tools/planner/sweep.py) is committed. Nothing here was measured: the
points come from a roofline-shaped formula for an 8B-parameter dense model on one
H100-class GPU per instance, and the file says so (device "synthetic").

The formula, so a reader can judge the numbers:
- prefill: a batch of `concurrency` prompts of `n` tokens runs together in
  20 ms + tokens / (peak x tokens / (tokens + 1024)) + an attention term quadratic
  in n; TTFT is that time, throughput is the batch's tokens over it.
- decode: one step reads the weights (16 GB) and every request's KV
  (batch x context x 128 KiB) at 3 TB/s, plus 0.04 ms of compute per request.
- vision: 30 ms + 8 ms per image in flight.

    python -m tools.planner.synthetic_profile --out docs/perf/profiles/synthetic_8b_h100.json
"""

import argparse
import sys

from services.planner.profile import DecodePoint, PrefillPoint, Profile, TransferRates, VisionPoint

PREFILL_LENGTHS = (128, 512, 1024, 2048, 4096, 8192)
PREFILL_CONCURRENCY = (1, 2, 4, 8, 16)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384)
VISION_CONCURRENCY = (1, 2, 4, 8, 16, 32)
KV_BYTES_PER_TOKEN = 128 * 1024  # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def synthetic_profile(prefill_peak_tokens_per_s: float = 24_000.0, decode_bandwidth_gb_s: float = 3_000.0,
                      weight_gb: float = 16.0) -> Profile:
    prefill = []
    for n in PREFILL_LENGTHS:
        for c in PREFILL_CONCURRENCY:
            tokens = n * c
            seconds = 0.020 + tokens / (prefill_peak_tokens_per_s * tokens / (tokens + 1024)) + c * (n / 8192) ** 2 * 0.05
            prefill.append(PrefillPoint(input_tokens=n, concurrency=c, ttft_ms=seconds * 1000,
                                        tokens_per_s=tokens / seconds))
    decode = []
    for b in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            seconds = (weight_gb * 1e9 + b * ctx * KV_BYTES_PER_TOKEN) / (decode_bandwidth_gb_s * 1e9) + b * 40e-6
            decode.append(DecodePoint(batch=b, context_tokens=ctx, itl_ms=seconds * 1000, tokens_per_s=b / seconds))
    vision = [VisionPoint(concurrency=c, images_per_s=c / (0.030 + 0.008 * c), latency_ms=(0.030 + 0.008 * c) * 1000)
              for c in VISION_CONCURRENCY]
    return Profile(model="synthetic 8B dense (Llama-3-8B-shaped)", device="synthetic", commit="synthetic",
                   command="python -m tools.planner.synthetic_profile", created_unix=0.0,
                   settings={"source": "formula in tools/planner/synthetic_profile.py, not measured"},
                   prefill=prefill, decode=decode, vision=vision,
                   transfer=TransferRates(kvcache_gb_s=10.0, handoff_gb_s=None, kv_bytes_per_token=KV_BYTES_PER_TOKEN))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.planner.synthetic_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    synthetic_profile().save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
