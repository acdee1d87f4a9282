"""`infermesh bench-gpu --profile`: where a decode step's time goes on the GPU.

Two views, both on Llama-3-8B's shape in bfloat16 with seeded random weights:

- the matmuls alone: each projection's weight shape at decode batch sizes,
  timed from a CUDA graph over enough weight copies that none sits in L2, as
  the fraction of the copy bandwidth that reading the weight once reaches;
- one decode step of the model runner, its kernels grouped by kind (matmul,
  attention, norms, ...) from the PyTorch profiler, summed against the step's
  time when replayed from a CUDA graph: the difference is the time the GPU
  spends between kernels.
"""

from collections import defaultdict
from pathlib import Path

import torch

from tools.bench.gpu_bench import _time, build_models, kv_bytes_per_token, measure_card, weight_bytes
from shared.engine.model_runner import ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.step import NewRequestData, ScheduledChunk, SchedulerOutput
from shared.model.interface import CausalLM
from tools.bench.raw_file import write_json

# (name, out_features, in_features) of Llama-3-8B's matmuls.
SHAPES = [
    ("q_proj", 4096, 4096),
    ("k_proj/v_proj", 1024, 4096),
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_proj/up_proj", 14336, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
    ("lm_head", 128256, 4096),
]

# Substrings of kernel names -> the kind they are counted under (first match wins).
KINDS = [
    ("attention", ("_decode_kernel", "_reduce_kernel", "_prefill_kernel", "flash", "attention")),
    ("norm", ("rms", "norm")),
    ("rotary", ("rotary",)),
    ("activation", ("silu",)),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "splitk", "cublas")),
    ("copy/index", ("copy", "index", "scatter", "gather", "fill", "elementwise", "where", "cat")),
    ("sampling", ("argmax", "reduce", "max")),
]


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


GEMV_CONFIGS = [(4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 8, 3), (16, 256, 4, 4), (16, 512, 8, 3),
                (32, 256, 8, 3), (2, 2048, 4, 2), (8, 256, 4, 4)]  # (block_n, block_k, warps, stages)


def _graph_time(run, copies: int) -> float:  # noqa: ANN001
    """Seconds per call of run()'s `copies` calls, replayed from a CUDA graph."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return _time(graph.replay, warmup=2, iters=10) / copies


def profile_matmuls(bw: float, batches: tuple[int, ...] = (1, 8, 64, 256)) -> list[dict]:
    from shared.model.kernels.gemv import gemv

    rows = []
    for name, n, k in SHAPES:
        copies = max(2, -(-(256 << 20) // (n * k * 2)))  # >= 256 MiB of weights in rotation: L2 is 50 MB
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for b in batches:
            x = torch.randn(b, k, dtype=torch.bfloat16, device="cuda")
            outs = [torch.empty(b, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]

            def run() -> None:
                for w, o in zip(weights, outs):
                    torch.nn.functional.linear(x, w, out=o)  # noqa: B023

            seconds = _graph_time(run, copies)
            frac = n * k * 2 / seconds / bw
            rows.append(dict(name=name, n=n, k=k, batch=b, us=seconds * 1e6, of_copy_bw=frac))
            print(f"matmul {name:18s} [{n}x{k}] batch {b:4d}: {seconds * 1e6:7.1f} us, {frac:.2f} of copy bandwidth", flush=True)
            if b != 1:
                continue
            for bn, bk, warps, stages in GEMV_CONFIGS:
                def run_gemv() -> None:
                    for w in weights:
                        gemv(x, w, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)  # noqa: B023

                try:
                    seconds = _graph_time(run_gemv, copies)
                except Exception as e:  # noqa: BLE001 - a config that does not compile: note it and go on
                    print(f"  gemv {bn},{bk},{warps},{stages}: {str(e)[:80]}")
                    continue
                frac = n * k * 2 / seconds / bw
                rows.append(dict(name=name, n=n, k=k, batch=1, kernel="gemv", config=[bn, bk, warps, stages],
                                 us=seconds * 1e6, of_copy_bw=frac))  # fmt: skip
                print(f"  triton gemv bn={bn} bk={bk} w={warps} s={stages}: {seconds * 1e6:7.1f} us, {frac:.2f}", flush=True)
        del weights, outs
        torch.cuda.empty_cache()
    return rows


def profile_step(model: CausalLM, batch: int, context: int, block_size: int = 16) -> dict:
    """One decode step's kernels by kind (eager launches, profiled) against its graph replay."""
    from torch.profiler import ProfilerActivity, profile

    blocks_per_seq = -(-(context + 8) // block_size)
    runners = {}
    for graphs in (False, True):
        runners[graphs] = ModelRunner(
            model, batch * blocks_per_seq, block_size, torch.bfloat16, torch.device("cuda"),
            cuda_graphs=graphs, max_model_len=blocks_per_seq * block_size, max_batch=batch,
        )  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]

    def step(runner: ModelRunner, first: bool) -> None:
        new = [NewRequestData(str(i), [1] * context, params, frozenset(), []) for i in range(batch)] if first else []
        sched = SchedulerOutput(new_requests=new)
        sched.chunks = [ScheduledChunk(str(i), [7], context, [tables[i]], True) for i in range(batch)]
        runner.execute(sched)

    for graphs, runner in runners.items():
        step(runner, True)
        step(runner, False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(runners[False], False)
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[_kind(ev.name)] += ev.time_range.elapsed_us() / 3
            by_name[ev.name] += ev.time_range.elapsed_us() / 3
    graph_step = _time(lambda: step(runners[True], False), warmup=2, iters=10) * 1e6
    graph_forward = None
    graphs = runners[True].graphs
    if graphs is not None:
        graph_forward = _time(graphs._graphs[graphs._bucket(batch)][0].replay, warmup=2, iters=10) * 1e6
    kernels_us = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    del runners
    torch.cuda.empty_cache()
    return dict(
        batch=batch, context=context, kernels_us=kernels_us, by_kind_us=dict(by_kind),
        graph_forward_us=graph_forward, graph_step_us=graph_step, top_kernels_us=top,
    )  # fmt: skip


def _paged_cache(seq_lens: list[int], block_size: int = 16, kv_heads: int = 8, head_dim: int = 128):  # noqa: ANN202
    """A bf16 cache holding the sequences in shuffled blocks, and their block tables."""
    blocks = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks), device="cuda")
    cache = torch.randn(2, sum(blocks), block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start : start + n]
        start += n
    return cache, tables


def sweep_attention(bw: float) -> dict:
    """The attention kernels alone over their tile settings: prefill of one 8k prompt
    (TFLOP/s of the causal part) and decode at a few shapes (GB/s of KV read)."""
    from shared.model.kernels.paged_decode import choose_num_splits, paged_decode_attention
    from shared.model.kernels.paged_prefill import paged_prefill_attention

    heads, kv_heads, head_dim, n = 32, 8, 128, 8192
    cache, tables = _paged_cache([n])
    q = torch.randn(n, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    flops = 4 * heads * head_dim * n * (n + 1) / 2
    prefill = []
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    try:
                        t = _time(lambda: paged_prefill_attention(q, cache, qsl, lens, tables, n, head_dim**-0.5,  # noqa: B023
                                  block_m=bm, block_n=bn, num_warps=warps, num_stages=stages), warmup=1, iters=5)  # noqa: B023
                    except Exception as e:  # noqa: BLE001 - out of shared memory etc.: record and go on
                        prefill.append(dict(block_m=bm, block_n=bn, warps=warps, stages=stages, error=str(e)[:80]))
                        continue
                    prefill.append(dict(block_m=bm, block_n=bn, warps=warps, stages=stages, us=t * 1e6, tflops=flops / t / 1e12))
                    print(f"prefill attn 8k bm={bm} bn={bn} w={warps} s={stages}: {t * 1e6:.0f} us, {flops / t / 1e12:.0f} TFLOP/s", flush=True)
    del cache, q
    decode = []
    # Decode kernels run for microseconds: time them replayed from a CUDA graph, as the
    # engine runs them (a Python launch per call would be slower than the kernel).
    for batch, ctx in ((1, 1024), (1, 8192), (8, 1024), (8, 8192), (64, 1024), (64, 8192), (256, 1024)):
        cache, tables = _paged_cache([ctx] * batch)
        q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        kv_bytes = batch * ctx * kv_heads * head_dim * 2 * 2
        best = None
        for bn in (32, 64, 128):
            chosen = choose_num_splits(batch, kv_heads, ctx, bn, q.device)
            for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
                for splits in sorted({1, 2, 4, 8, 16, 32, 64, chosen}):
                    if splits > 1 and ctx // bn < splits:
                        continue

                    def run() -> None:
                        paged_decode_attention(q, cache, lens, tables, head_dim**-0.5, None, splits,  # noqa: B023
                                               block_n=bn, num_warps=warps, num_stages=stages)  # noqa: B023

                    try:
                        t = _graph_time(run, 1)
                    except Exception as e:  # noqa: BLE001 - out of shared memory etc.: note it and go on
                        print(f"decode attn b={batch} ctx={ctx} bn={bn} w={warps} s={stages}: {str(e)[:80]}")
                        continue
                    row = dict(batch=batch, ctx=ctx, block_n=bn, warps=warps, stages=stages, splits=splits,
                               chosen_splits=chosen, us=t * 1e6, of_copy_bw=kv_bytes / t / bw)  # fmt: skip
                    decode.append(row)
                    if best is None or row["us"] < best["us"]:
                        best = row
        default = [r for r in decode if (r["batch"], r["ctx"], r["block_n"], r["warps"], r["stages"]) == (batch, ctx, 64, 4, 2)
                   and r["splits"] == r["chosen_splits"]]  # fmt: skip
        print(f"decode attn b={batch} ctx={ctx}: best {best}; default {default}", flush=True)
        del cache, q
        torch.cuda.empty_cache()
    return dict(prefill=prefill, decode=decode)


def run_profile(out_dir: str, seed: int = 0) -> dict:
    bw, rate = measure_card()
    print(f"card: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    attention = sweep_attention(bw)
    matmuls = profile_matmuls(bw)
    config, model, _ = build_models(seed, with_hf=False)
    wbytes = weight_bytes(model)
    kv_tok = kv_bytes_per_token(config)
    steps = []
    for batch, context in ((1, 1024), (8, 1024), (64, 1024), (256, 1024), (8, 8192)):
        s = profile_step(model, batch, context)
        s["roofline_us"] = (wbytes + batch * context * kv_tok) / bw * 1e6
        steps.append(s)
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["by_kind_us"].items(), key=lambda kv: -kv[1]))
        print(
            f"decode b={batch} ctx={context}: roofline {s['roofline_us']:.0f} us; kernels {s['kernels_us']:.0f} us "
            f"({kinds}); graph forward {s['graph_forward_us']:.0f} us; runner step {s['graph_step_us']:.0f} us",
            flush=True,
        )
        for name, us in s["top_kernels_us"]:
            print(f"    {us:8.1f} us  {name[:110]}")
    record = dict(device=torch.cuda.get_device_name(), copy_bytes_per_s=bw, bf16_flop_per_s=rate,
                  attention_sweep=attention, matmuls=matmuls, decode_steps=steps)  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "profile.json", record)
    return record
