"""The prefill attention tile settings measured inside the whole model (K/V cold in L2
after the matmuls), not in the kernel alone. Run on the GPU machine:
`PYTHONPATH=$PWD python3 tests/gpu/prefill_tiles.py`."""

import torch
from shared.bench.gpu_bench import build_models, _time
from shared.engine.model_runner import ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
from shared.model.kernels import paged_prefill as pp

config, model, _ = build_models(0, with_hf=False)
orig = pp._tile_shape
def step_fn(n):
    blocks = -(-n // 16)
    runner = ModelRunner(model, blocks + 1, 16, torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(0, 100000, (n,)).tolist()
    def step():
        sched = SchedulerOutput(new_requests=[NewRequestData("p", ids, SamplingParams(max_tokens=1, temperature=0.0), frozenset(), [], None)])
        sched.chunks = [ScheduledChunk("p", ids, 0, list(range(blocks)), True)]
        runner.execute(sched)
    return step
steps = {n: step_fn(n) for n in (1024, 8192)}
for bm, bn, w, s in ((128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4)):
    pp._tile_shape = lambda *a, c=(bm, bn, w, s): c
    r = {n: _time(st, warmup=1, iters=5) for n, st in steps.items()}
    print(f"tiles {bm}x{bn} w{w} s{s}: 1k {r[1024]*1e3:.2f} ms ({1024/r[1024]:.0f} tok/s), 8k {r[8192]*1e3:.1f} ms ({8192/r[8192]:.0f} tok/s)", flush=True)
