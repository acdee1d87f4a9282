"""Diagnostics behind docs/perf/README.md's prefill and batch-1 findings, on the
Llama-3-8B-shaped model of `bench-gpu` (seeded random bf16 weights):

- kernels: where a prefill step's time goes, kernels grouped by kind, 1k and 8k prompts;
- tiles: the prefill attention tile settings timed inside the whole model (K/V cold
  in L2 after the matmuls), which ranks them differently from the kernel alone;
- mlp: batch-1 decode's graph forward with the MLP activation fused into the down
  GEMV against the separate SiLU-and-mul kernel.

Run on the GPU machine: `PYTHONPATH=$PWD python3 tests/gpu/profile_prefill.py [--only kernels,tiles,mlp]`.
"""

import argparse
from collections import defaultdict
from collections.abc import Callable

import torch

from tools.bench.gpu_bench import _time, build_models
from tools.bench.gpu_profile import _kind
from shared.engine.model_runner import ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
from shared.model import layers
from shared.model.kernels import paged_prefill
from shared.model.interface import CausalLM

BLOCK = 16


def prefill_step(model: CausalLM, prompt_len: int) -> Callable[[], None]:
    """One whole prefill of a random prompt through the model runner (eager)."""
    blocks = -(-prompt_len // BLOCK)
    runner = ModelRunner(model, blocks + 1, BLOCK, torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(0, 100000, (prompt_len,)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def step() -> None:
        sched = SchedulerOutput(new_requests=[NewRequestData("p", ids, params, frozenset(), [])])
        sched.chunks = [ScheduledChunk("p", ids, 0, list(range(blocks)), True)]
        runner.execute(sched)

    return step


def kernels(model: CausalLM) -> None:
    from torch.profiler import ProfilerActivity, profile

    for n in (1024, 8192):
        step = prefill_step(model, n)
        seconds = _time(step, warmup=1, iters=3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        by_kind: dict[str, float] = defaultdict(float)
        by_name: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by_kind[_kind(ev.name)] += ev.time_range.elapsed_us()
                by_name[ev.name] += ev.time_range.elapsed_us()
        kinds = {k: round(v / 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
        print(f"PREFILL {n}: step {seconds * 1e3:.2f} ms; kernels {sum(by_kind.values()) / 1e3:.2f} ms: {kinds}")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]:
            print(f"   {us / 1e3:8.2f} ms {name[:100]}")
        torch.cuda.empty_cache()


def tiles(model: CausalLM) -> None:
    steps = {n: prefill_step(model, n) for n in (1024, 8192)}
    chosen = paged_prefill._tile_shape
    try:
        for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 64, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)):
            paged_prefill._tile_shape = lambda *_, c=(bm, bn, warps, stages): c
            t = {n: _time(step, warmup=1, iters=5) for n, step in steps.items()}
            print(f"tiles {bm}x{bn} w{warps} s{stages}: 1k {t[1024] * 1e3:.2f} ms ({1024 / t[1024]:.0f} tok/s), "
                  f"8k {t[8192] * 1e3:.1f} ms ({8192 / t[8192]:.0f} tok/s)", flush=True)  # fmt: skip
    finally:
        paged_prefill._tile_shape = chosen


def mlp(model: CausalLM) -> None:
    fused = layers.MLP.forward

    def separate(self: layers.MLP, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self._act(gate, up))

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        for name, forward in (("SiLU inside the down GEMV", fused), ("SiLU kernel, then GEMV", separate)):
            layers.MLP.forward = forward  # type: ignore[method-assign]
            runner = ModelRunner(model, 80, BLOCK, torch.bfloat16, torch.device("cuda"), cuda_graphs=True,
                                 max_model_len=1280, max_batch=1)  # fmt: skip
            for first in (True, False):
                sched = SchedulerOutput(new_requests=[NewRequestData("0", [1] * 1024, params, frozenset(), [])] if first else [])
                sched.chunks = [ScheduledChunk("0", [7], 1024, list(range(70)), True)]
                runner.execute(sched)
            assert runner.graphs is not None
            seconds = _time(runner.graphs._graphs[1][0].replay, warmup=3, iters=30)
            print(f"DECODE b=1 ctx=1024 graph forward, {name}: {seconds * 1e6:.0f} us")
            del runner
            torch.cuda.empty_cache()
    finally:
        layers.MLP.forward = fused  # type: ignore[method-assign]


def main() -> None:
    sections = {"kernels": kernels, "tiles": tiles, "mlp": mlp}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(sections), help=f"comma-separated subset of {','.join(sections)}")
    args = parser.parse_args()
    _, model, _ = build_models(0, with_hf=False)
    for name in args.only.split(","):
        sections[name](model)


if __name__ == "__main__":
    main()
