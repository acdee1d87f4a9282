"""Where a prefill step's time goes (kernels by kind at 1k and 8k prompts), and batch-1
decode's graph forward with the MLP activation fused into the down GEMV or not.
Run on the GPU machine: `PYTHONPATH=$PWD python3 tests/gpu/profile_prefill.py`."""

import torch
from collections import defaultdict
from torch.profiler import ProfilerActivity, profile
from shared.bench.gpu_bench import build_models, _time
from shared.bench.gpu_profile import _kind
from shared.engine.model_runner import ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
from shared.model import layers

config, model, _ = build_models(0, with_hf=False)

def prefill_runner(n):
    blocks = -(-n // 16)
    runner = ModelRunner(model, blocks + 1, 16, torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(0, 100000, (n,)).tolist()
    def step():
        sched = SchedulerOutput(new_requests=[NewRequestData("p", ids, SamplingParams(max_tokens=1, temperature=0.0), frozenset(), [], None)])
        sched.chunks = [ScheduledChunk("p", ids, 0, list(range(blocks)), True)]
        runner.execute(sched)
    return step

for n in (1024, 8192):
    step = prefill_runner(n)
    t = _time(step, warmup=1, iters=3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    kinds = defaultdict(float); names = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kinds[_kind(ev.name)] += ev.time_range.elapsed_us(); names[ev.name] += ev.time_range.elapsed_us()
    print(f"PREFILL {n}: step {t*1e3:.2f} ms; kernels {sum(kinds.values())/1e3:.2f} ms:", {k: round(v/1e3, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])})
    for name, us in sorted(names.items(), key=lambda kv: -kv[1])[:8]:
        print(f"   {us/1e3:8.2f} ms {name[:100]}")
    torch.cuda.empty_cache()

# batch-1 decode forward from a graph, activation fused into the down GEMV or not
fused_forward = layers.MLP.forward
def unfused(self, x):
    gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
    return self.down_proj(self._act(gate, up))
for name, fwd in (("gated gemv", fused_forward), ("silu kernel + gemv", unfused), ("gated gemv again", fused_forward)):
    layers.MLP.forward = fwd
    runner = ModelRunner(model, 80, 16, torch.bfloat16, torch.device("cuda"), cuda_graphs=True, max_model_len=1280, max_batch=1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    new = [NewRequestData("0", [1] * 1024, params, frozenset(), [], None)]
    for first in (True, False):
        sched = SchedulerOutput(new_requests=new if first else [])
        sched.chunks = [ScheduledChunk("0", [7], 1024, list(range(70)), True)]
        runner.execute(sched)
    g = runner.graphs
    t = _time(g._graphs[1][0].replay, warmup=3, iters=30)
    print(f"DECODE b=1 ctx=1024 graph forward, {name}: {t*1e6:.0f} us")
    del runner; torch.cuda.empty_cache()
