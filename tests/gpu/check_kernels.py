#!/usr/bin/env python3
"""GPU check of the Triton kernels in shared/model/kernels: each against its PyTorch
reference in bfloat16 and float32 at Llama-3-8B sizes (32 query heads, 8 kv heads,
head_dim 128, KV blocks of 16 tokens, contexts 1k and 8k, batches 1..256), timed with
``triton.testing.do_bench`` against the reference; decode also replayed from a CUDA
graph. Prints one table per section and exits non-zero on any mismatch or crash.

Usage, from the repository root:
    python3 tests/gpu/check_kernels.py              # the H200 run (a few minutes)
    python3 tests/gpu/check_kernels.py --tiny       # tiny sizes; on a CPU under TRITON_INTERPRET=1
Options: --no-sweep (skip the decode num_splits sweep), --only decode,prefill,floor,elementwise,graph,sweep,model.

Attention is checked against a float32 "truth" computed by the reference from the same
(upcast) inputs; in bf16 the kernel's error must stay within a few times PyTorch's own
bf16 error (or an absolute floor). Elementwise kernels compare with the reference directly.
No pytest needed; only torch and triton (3.6 on the device).
"""

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

SECTIONS = ("elementwise", "gemv", "decode", "prefill", "floor", "graph", "sweep", "model")


@dataclass(frozen=True)
class Sizes:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    intermediate: int
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    decode_fp32: tuple[tuple[int, int], ...]
    decode_window: tuple[int, int, int]  # (batch, context, window)
    prefill: tuple[tuple[str, tuple[tuple[int, int], ...], int | None], ...]  # (name, ((cached, new), ...), window)
    prefill_fp32: tuple[str, ...]
    tokens: tuple[int, ...]  # elementwise token counts
    sweep: tuple[tuple[int, int], ...]
    model_prompts: tuple[int, ...]
    model_decode_batch: tuple[int, int]  # (batch, context) of the timed decode step
    # Sliding-window replay with a key floor: (name, ((cached, new, floor), ...), window); (batch, context, window).
    floor_prefill: tuple[tuple[str, tuple[tuple[int, int, int], ...], int], ...]
    floor_decode: tuple[tuple[int, int, int], ...]


FULL = Sizes(
    heads=32, kv_heads=8, head_dim=128, block_size=16, hidden=4096, intermediate=14336,
    decode=tuple((b, c) for c in (1024, 8192) for b in (1, 8, 32, 64, 128, 256)),
    decode_fp32=((1, 1024), (32, 1024), (8, 8192), (256, 8192)),
    decode_window=(32, 8192, 4096),
    prefill=(
        ("1 prompt x 8192", ((0, 8192),), None),
        ("4 prompts x 2048", ((0, 2048),) * 4, None),
        ("4 chunks 512 on 4096 cached", ((4096, 512),) * 4, None),
        ("chunk 2048 on 6144 + 64 decodes @1k", ((6144, 2048),) + ((1023, 1),) * 64, None),
        ("1 prompt x 8192, window 4096", ((0, 8192),), 4096),
    ),
    prefill_fp32=("4 prompts x 2048", "4 chunks 512 on 4096 cached"),
    tokens=(1, 256, 8192),
    sweep=((1, 8192), (8, 8192), (32, 1024), (32, 8192), (64, 8192)),
    model_prompts=(500, 300, 129, 64),
    model_decode_batch=(64, 1024),
    floor_prefill=(
        ("4 replays of 2048 (one chunked), window 4096", ((4096, 2048, 4096), (4100, 2048, 4100), (3001, 1024, 3001),
                                                          (6000, 2048, 5013)), 4096),
        ("chunk 1024 replaying from 5003 + 64 decodes @1k", ((6144, 1024, 5003),) + ((1023, 1, 700),) * 64, 4096),
    ),
    floor_decode=((1, 8192, 4096), (32, 8192, 4096), (128, 1024, 512)),
)  # fmt: skip
TINY = Sizes(
    heads=4, kv_heads=2, head_dim=32, block_size=4, hidden=64, intermediate=96,
    decode=((1, 40), (3, 40)), decode_fp32=((3, 40),), decode_window=(2, 40, 9),
    prefill=(("2 prompts", ((0, 9), (0, 5)), None), ("chunk + decodes", ((7, 6), (12, 1), (3, 1)), 5)),
    prefill_fp32=("2 prompts",), tokens=(3,), sweep=((1, 70),), model_prompts=(7, 5), model_decode_batch=(2, 20),
    floor_prefill=(("replays, a chunk, a decode", ((8, 6, 8), (13, 5, 9), (0, 4, 0), (11, 1, 6)), 9),),
    floor_decode=((1, 40, 20), (3, 40, 20)),
)  # fmt: skip

# The interpreter gets bfloat16 wrong silently (shared/STACK.md): on the CPU, float16 stands in.
GPU_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CPU_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


class Checker:
    def __init__(self, device: torch.device, tiny: bool) -> None:
        self.device = device
        self.tiny = tiny
        self.dtypes = GPU_DTYPES if device.type == "cuda" else CPU_DTYPES
        self.low = next(iter(self.dtypes.values()))  # the 16-bit dtype
        self.failures: list[str] = []
        self.rows: list[list[str]] = []

    def bench(self, fn: Callable[[], object]) -> float:
        """Microseconds per call: do_bench's median on CUDA, one timed call on the CPU."""
        if self.device.type == "cuda":
            import triton.testing

            return 1000 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"  MISMATCH: {what}", flush=True)

    def table(self, title: str, header: list[str]) -> None:
        if self.rows:
            widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(len(header))]
            print(f"\n== {title}")
            for r in [header, *self.rows]:
                print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        self.rows = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


# -- paged inputs ------------------------------------------------------------------


@dataclass
class Paged:
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]


def make_paged(seq_lens: list[int], sz: Sizes, dtype: torch.dtype, device: torch.device, seed: int) -> Paged:
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-n // sz.block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    kv = torch.randn(2, num_blocks, sz.block_size, sz.kv_heads, sz.head_dim, generator=g, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[start : start + n]
        start += n
    return Paged(kv, tables, seq_lens)


def padded_size(starts: list[int], seq_lens: list[int]) -> int:
    """Score entries per head of the reference, which pads queries and keys to the longest."""
    max_q = max(starts[i + 1] - starts[i] for i in range(len(seq_lens)))
    return len(seq_lens) * max_q * max(seq_lens)


def truth(query: torch.Tensor, paged: Paged, starts: list[int], window: int | None, scale: float,
          key_floor: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """The reference in float32 on the upcast inputs, a few sequences at a time (memory)."""
    from shared.model.kernels.reference import paged_attention_ref

    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    kv = paged.kv_cache.float()
    s = 0
    while s < len(paged.seq_lens):
        e = s + 1  # grow the chunk while its gathered K/V and padded scores stay small
        while (
            e < len(paged.seq_lens)
            and sum(paged.seq_lens[s : e + 1]) <= 1 << 17
            and padded_size(starts[s : e + 2], paged.seq_lens[s : e + 1]) <= 1 << 26
        ):
            e += 1
        a, b = starts[s], starts[e]
        local = [x - a for x in starts[s : e + 1]]
        floor = None if key_floor is None else key_floor[s:e]
        out[a:b] = paged_attention_ref(query[a:b].float(), kv, local, paged.seq_lens[s:e], paged.block_tables[s:e], window,
                                       scale, floor)  # fmt: skip
        s = e
    return out


def attention_verdict(ck: Checker, what: str, dtype: torch.dtype, out: torch.Tensor, ref_out: torch.Tensor | None,
                      exact: torch.Tensor) -> tuple[str, str]:  # fmt: skip
    err = rel(out, exact)
    torch_err = None if ref_out is None else rel(ref_out, exact)
    # fp32: full-precision products on both sides. 16-bit: within 4x PyTorch's own error, or 1e-2.
    limit = 1e-4 if dtype == torch.float32 else max(1e-2, 4 * (torch_err or 0.0))
    if not err <= limit:  # also catches NaN
        ck.fail(f"{what}: error {err:.2e} > {limit:.1e}")
    return f"{err:.1e}", "-" if torch_err is None else f"{torch_err:.1e}"


# -- sections ------------------------------------------------------------------------


def check_decode(ck: Checker, sz: Sizes) -> None:
    from shared.model.attention import attend, plan_attention
    from shared.model.forward_batch import AttentionMetadata
    from shared.model.kernels.paged_decode import choose_num_splits, paged_decode_attention

    scale = sz.head_dim**-0.5
    low = next(iter(ck.dtypes))
    configs = [(n, b, c, None) for n in ck.dtypes for b, c in (sz.decode if n == low else sz.decode_fp32)]
    configs.append((low, *sz.decode_window))
    for name, batch, ctx, window in configs:
        dtype = ck.dtypes[name]
        lens = [ctx - (i * 37) % min(64, ctx) for i in range(batch)]
        paged = make_paged(lens, sz, dtype, ck.device, seed=batch + ctx)
        q = torch.randn(batch, sz.heads, sz.head_dim, device=ck.device, dtype=dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=ck.device)
        splits = choose_num_splits(batch, sz.kv_heads, max(lens), 64 if sz.head_dim <= 128 else 32, ck.device)
        out = paged_decode_attention(q, paged.kv_cache, seq_lens, paged.block_tables, scale, window)
        starts = list(range(batch + 1))
        exact = truth(q, paged, starts, window, scale)
        ref_out = t_ref = None
        if batch * ctx <= (1 << 18) or ck.tiny:  # the reference's gathered K/V must fit
            meta = AttentionMetadata(torch.empty(0, dtype=torch.int64, device=ck.device), paged.block_tables, starts, lens, sz.block_size)
            plan = plan_attention(meta, [window], ck.device)
            ref_out = attend(q, paged.kv_cache, plan, window, scale)
            t_ref = ck.bench(lambda: attend(q, paged.kv_cache, plan, window, scale))
            del plan
        what = f"decode {name} batch {batch} ctx {ctx}" + (f" window {window}" if window else "")
        err, torch_err = attention_verdict(ck, what, dtype, out, ref_out, exact)
        t = ck.bench(lambda: paged_decode_attention(q, paged.kv_cache, seq_lens, paged.block_tables, scale, window))
        kv_bytes = sum(min(n, window or n) for n in lens) * sz.kv_heads * sz.head_dim * 2 * dtype.itemsize
        ck.rows.append([name, str(batch), str(ctx), str(window or "-"), str(splits), err, torch_err, us(t), us(t_ref),
                        "-" if t_ref is None else f"{t_ref / t:.1f}x", f"{kv_bytes / t / 1e3:.0f}"])  # fmt: skip
        del paged, q, out, exact, ref_out
        if ck.device.type == "cuda":
            torch.cuda.empty_cache()
    ck.table("paged decode (us per call incl. Python launch; GB/s = KV bytes / triton time)",
             ["dtype", "batch", "ctx", "window", "splits", "err", "torch err", "triton us", "torch us", "speedup", "GB/s"])  # fmt: skip


def check_graph(ck: Checker, sz: Sizes) -> None:
    """Decode captured in a CUDA graph with static inputs: change lengths and tables in
    place, replay, compare; and the replay time (the kernel without Python launch cost)."""
    from shared.model.kernels.paged_decode import paged_decode_attention

    if ck.device.type != "cuda":
        print("\n== graph: skipped (no CUDA)")
        return
    scale = sz.head_dim**-0.5
    for batch, ctx in [bc for bc in sz.decode if bc[0] in (1, 32, 256)]:
        dtype = ck.low
        paged = make_paged([ctx] * batch, sz, dtype, ck.device, seed=7)
        q = torch.randn(batch, sz.heads, sz.head_dim, device=ck.device, dtype=dtype)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=ck.device)
        out = torch.empty_like(q)
        paged_decode_attention(q, paged.kv_cache, seq_lens, paged.block_tables, scale, out=out)  # compile first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode_attention(q, paged.kv_cache, seq_lens, paged.block_tables, scale, out=out)
        # New lengths and a reversed table order, written into the captured tensors.
        new_lens = [max(1, ctx - (i * 131) % ctx) for i in range(batch)]
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        paged.block_tables.copy_(paged.block_tables.flip(0))
        paged.seq_lens = new_lens
        q.copy_(torch.randn_like(q))
        graph.replay()
        exact = truth(q, paged, list(range(batch + 1)), None, scale)
        err, _ = attention_verdict(ck, f"graph replay batch {batch} ctx {ctx}", dtype, out, None, exact)
        t = ck.bench(graph.replay)
        kv_bytes = sum(new_lens) * sz.kv_heads * sz.head_dim * 2 * dtype.itemsize
        ck.rows.append([str(dtype).removeprefix("torch."), str(batch), str(ctx), err, us(t), f"{kv_bytes / t / 1e3:.0f}"])
        del graph, paged, q, out
        torch.cuda.empty_cache()
    ck.table("paged decode from a CUDA graph (replay us)", ["dtype", "batch", "ctx", "err", "replay us", "GB/s"])


def check_sweep(ck: Checker, sz: Sizes) -> None:
    """Replay time of decode for each num_splits: data to tune choose_num_splits."""
    from shared.model.kernels.paged_decode import choose_num_splits, paged_decode_attention

    scale = sz.head_dim**-0.5
    header = ["batch", "ctx", "chosen"] + [str(n) for n in (1, 2, 4, 8, 16, 32, 64)]
    for batch, ctx in sz.sweep:
        paged = make_paged([ctx] * batch, sz, ck.low, ck.device, seed=3)
        q = torch.randn(batch, sz.heads, sz.head_dim, device=ck.device, dtype=ck.low)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=ck.device)
        row = [str(batch), str(ctx), str(choose_num_splits(batch, sz.kv_heads, ctx, 64, ck.device))]
        for n in (1, 2, 4, 8, 16, 32, 64):
            fn = lambda: paged_decode_attention(q, paged.kv_cache, seq_lens, paged.block_tables, scale, None, n)  # noqa: E731
            fn()
            if ck.device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                row.append(us(ck.bench(graph.replay)))
            else:
                row.append(us(ck.bench(fn)))
        ck.rows.append(row)
    ck.table(f"decode num_splits sweep, {ck.low} (graph replay us on CUDA)", header)


def check_prefill(ck: Checker, sz: Sizes) -> None:
    from shared.model.attention import attend, plan_attention
    from shared.model.forward_batch import AttentionMetadata
    from shared.model.kernels.paged_prefill import paged_prefill_attention

    scale = sz.head_dim**-0.5
    configs = [(n, p) for n, d in ck.dtypes.items() for p in sz.prefill if d != torch.float32 or p[0] in sz.prefill_fp32]
    for name, (label, seqs, window) in configs:
        dtype = ck.dtypes[name]
        lens = [c + n for c, n in seqs]
        starts = [0]
        for _, n in seqs:
            starts.append(starts[-1] + n)
        paged = make_paged(lens, sz, dtype, ck.device, seed=len(seqs))
        q = torch.randn(starts[-1], sz.heads, sz.head_dim, device=ck.device, dtype=dtype)
        qsl = torch.tensor(starts, dtype=torch.int32, device=ck.device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=ck.device)
        max_q = max(n for _, n in seqs)
        args = (q, paged.kv_cache, qsl, seq_lens, paged.block_tables, max_q, scale, window)
        out = paged_prefill_attention(*args)
        exact = truth(q, paged, starts, window, scale)
        ref_out = t_ref = None
        if padded_size(starts, lens) * sz.heads <= 1 << 32:  # the reference's padded scores must fit
            empty = torch.empty(0, dtype=torch.int64, device=ck.device)
            plan = plan_attention(AttentionMetadata(empty, paged.block_tables, starts, lens, sz.block_size), [window], ck.device)
            ref_out = attend(q, paged.kv_cache, plan, window, scale)
            t_ref = ck.bench(lambda: attend(q, paged.kv_cache, plan, window, scale))
            del plan
        err, torch_err = attention_verdict(ck, f"prefill {name} {label}", dtype, out, ref_out, exact)
        t = ck.bench(lambda: paged_prefill_attention(*args))
        # Causal (and windowed) score entries, 2 matrix products of 2 flops each.
        pairs = sum(min(c + i + 1, window or c + i + 1) for c, n in seqs for i in range(n))
        tflops = 4 * pairs * sz.heads * sz.head_dim / t / 1e6
        speedup = "-" if t_ref is None else f"{t_ref / t:.1f}x"
        ck.rows.append([name, label, err, torch_err, us(t), us(t_ref), speedup, f"{tflops:.0f}"])
        del paged, q, out, exact, ref_out
        if ck.device.type == "cuda":
            torch.cuda.empty_cache()
    ck.table("paged prefill (us per call; TFLOP/s of the causal part)",
             ["dtype", "batch", "err", "torch err", "triton us", "torch us", "speedup", "TFLOP/s"])  # fmt: skip


def poison_below_floor(paged: Paged, floors: list[int], block_size: int) -> None:
    """What a replay leaves below each floor: no KV of this layer. Large random K/V there,
    so that a kernel reading any of it is far off."""
    positions = [torch.arange(f, device=paged.kv_cache.device) for f in floors]
    slots = torch.cat([paged.block_tables[s, p // block_size].long() * block_size + p % block_size
                       for s, p in enumerate(positions)])  # fmt: skip
    flat = paged.kv_cache.view(2, -1, *paged.kv_cache.shape[3:])
    flat[:, slots] = 100 * torch.randn(flat[:, slots].shape, device=flat.device, dtype=flat.dtype)


def check_floor(ck: Checker, sz: Sizes) -> None:
    """Sliding-window replay after a prefix hit: a key floor per sequence (keys below it
    hold garbage), prefill (replayed chunks beside decodes) and decode (split), against the
    float32 truth with the floor; without the floor the output must be far off (so the
    check checks something). Times with and without the floor: its cost."""
    from shared.model.kernels.paged_decode import choose_num_splits, paged_decode_attention
    from shared.model.kernels.paged_prefill import paged_prefill_attention

    scale = sz.head_dim**-0.5
    for name, dtype in ck.dtypes.items():
        # (what, paged, query, query starts, floors, window, splits, launch with a floor or None)
        runs: list[tuple[str, Paged, torch.Tensor, list[int], list[int], int, str, Callable[..., torch.Tensor]]] = []
        for label, seqs, window in sz.floor_prefill:
            lens, floors = [c + n for c, n, _ in seqs], [f for _, _, f in seqs]
            starts = [0]
            for _, n, _ in seqs:
                starts.append(starts[-1] + n)
            paged = make_paged(lens, sz, dtype, ck.device, seed=len(seqs))
            q = torch.randn(starts[-1], sz.heads, sz.head_dim, device=ck.device, dtype=dtype)
            qsl = torch.tensor(starts, dtype=torch.int32, device=ck.device)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=ck.device)
            max_q = max(n for _, n, _ in seqs)
            fn = lambda f, q=q, p=paged, qsl=qsl, sl=seq_lens, m=max_q, w=window: paged_prefill_attention(  # noqa: E731
                q, p.kv_cache, qsl, sl, p.block_tables, m, scale, w, f)
            runs.append((f"prefill {label}", paged, q, starts, floors, window, "-", fn))
        for batch, ctx, window in sz.floor_decode:
            lens = [ctx - (i * 37) % min(64, ctx) for i in range(batch)]
            # Floors inside the window (mid-block), every fourth sequence without one.
            floors = [0 if i % 4 == 3 else max(0, n - window // 2 - 1 - (i * 37) % 61) for i, n in enumerate(lens)]
            paged = make_paged(lens, sz, dtype, ck.device, seed=batch + ctx)
            q = torch.randn(batch, sz.heads, sz.head_dim, device=ck.device, dtype=dtype)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=ck.device)
            splits = choose_num_splits(batch, sz.kv_heads, max(lens), 64 if sz.head_dim <= 128 else 32, ck.device)
            fn = lambda f, q=q, p=paged, sl=seq_lens, w=window: paged_decode_attention(  # noqa: E731
                q, p.kv_cache, sl, p.block_tables, scale, w, None, f)
            runs.append((f"decode batch {batch} ctx {ctx}", paged, q, list(range(batch + 1)), floors, window, str(splits), fn))
        for what, paged, q, starts, floors, window, splits, fn in runs:
            poison_below_floor(paged, floors, sz.block_size)
            key_floor = torch.tensor(floors, dtype=torch.int32, device=ck.device)
            out, no_floor = fn(key_floor), fn(None)
            exact = truth(q, paged, starts, window, scale, floors)
            err, _ = attention_verdict(ck, f"{what} window {window} {name} with a key floor", dtype, out, None, exact)
            no_floor_err = rel(no_floor, exact)
            if not no_floor_err > 0.5:
                ck.fail(f"{what} {name}: without the floor the output is close to the truth ({no_floor_err:.1e})")
            t, t_none = ck.bench(lambda: fn(key_floor)), ck.bench(lambda: fn(None))  # noqa: B023
            ck.rows.append([name, what, str(window), splits, err, f"{no_floor_err:.1e}", us(t), us(t_none)])
            del out, no_floor, exact
        del runs
        if ck.device.type == "cuda":
            torch.cuda.empty_cache()
    ck.table("key floor (SWA replay): error with the floor and without it (must be far off), us with and without",
             ["dtype", "case", "window", "splits", "err", "no-floor err", "floor us", "no-floor us"])  # fmt: skip


def check_elementwise(ck: Checker, sz: Sizes) -> None:
    from shared.model.attention import write_kv
    from shared.model.arch_config import RopeConfig
    from shared.model.kernels import activation, reference, rmsnorm, rotary
    from shared.model.layers import RotaryEmbedding

    rope = RopeConfig("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)  # fmt: skip
    dev = ck.device
    tols = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-5),
            torch.float32: dict(rtol=1e-5, atol=1e-5)}  # fmt: skip
    for name, dtype in ck.dtypes.items():
        # 16-bit: bit-exact or 1 ulp (the rounding steps are PyTorch's); fp32 within a few ulps.
        tol = tols[dtype]
        for t in sz.tokens:
            x = torch.randn(t, sz.hidden, device=dev, dtype=dtype)
            r = torch.randn(t, sz.hidden, device=dev, dtype=dtype)
            w = (1 + 0.1 * torch.randn(sz.hidden, device=dev)).to(dtype)
            qk = torch.randn(t, sz.heads, sz.head_dim, device=dev, dtype=dtype)
            cases: list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor], int]] = [
                ("rms_norm", lambda: rmsnorm.rms_norm(x, w, 1e-5), lambda: reference.rms_norm_ref(x, w, 1e-5), 2 * x.nbytes),
                ("fused_add_rms_norm", lambda: rmsnorm.fused_add_rms_norm(x, r, w, 1e-5)[0],
                 lambda: reference.fused_add_rms_norm_ref(x, r, w, 1e-5)[0], 4 * x.nbytes),
                ("rms_norm per head", lambda: rmsnorm.rms_norm(qk, w[: sz.head_dim], 1e-6),
                 lambda: reference.rms_norm_ref(qk, w[: sz.head_dim], 1e-6), 2 * qk.nbytes),
            ]  # fmt: skip
            pos = torch.randint(0, 8192, (t,), device=dev)
            cos, sin = RotaryEmbedding(rope, sz.head_dim, dev)(pos, dtype)
            k = torch.randn(t, sz.kv_heads, sz.head_dim, device=dev, dtype=dtype)
            cases.append(("rotary q+k", lambda: torch.cat([o.flatten() for o in rotary.rotary_embedding_(qk.clone(), k.clone(), cos, sin)]),
                          lambda: torch.cat([o.flatten() for o in reference.rotary_ref(qk, k, cos, sin)]), 2 * (qk.nbytes + k.nbytes)))  # fmt: skip
            # The decode path's launch: q rotated in place, rotated k and v into their (shuffled) cache slots.
            v = torch.randn_like(k)
            cache = torch.zeros(2, t + 3, 1, sz.kv_heads, sz.head_dim, device=dev, dtype=dtype)
            slots = torch.randperm(t + 3, device=dev)[:t]

            def store_ref() -> torch.Tensor:
                ref_q, ref_k = reference.rotary_ref(qk, k, cos, sin)
                ref_cache = cache.clone()
                write_kv(ref_cache, ref_k, v, slots)
                return torch.cat([ref_q.flatten(), ref_cache.flatten()])

            def store_kernel() -> torch.Tensor:
                q_out, out_cache = qk.clone(), cache.clone()
                rotary.rotary_embedding_and_store_kv(q_out, k, v, cos, sin, out_cache, slots)
                return torch.cat([q_out.flatten(), out_cache.flatten()])

            cases.append(("rotary + store kv", store_kernel, store_ref, 2 * qk.nbytes + 4 * k.nbytes))
            gu = torch.randn(t, 2 * sz.intermediate, device=dev, dtype=dtype)
            gate, up = gu[:, : sz.intermediate], gu[:, sz.intermediate :]
            cases.append(("silu_and_mul", lambda: activation.silu_and_mul(gate, up), lambda: reference.silu_and_mul_ref(gate, up),
                          3 * gate.numel() * dtype.itemsize))  # fmt: skip
            for label, kernel, ref, nbytes in cases:
                out, expected = kernel(), ref()
                not_equal = (out != expected).sum().item()
                try:
                    torch.testing.assert_close(out, expected, **tol)
                except AssertionError as e:
                    ck.fail(f"{label} {name} T={t}: {str(e).splitlines()[0]}")
                if label == "rotary q+k":  # time the in-place kernel without the clones and cat
                    t_k = ck.bench(lambda: rotary.rotary_embedding_(qk, k, cos, sin))
                    t_r = ck.bench(lambda: reference.rotary_ref(qk, k, cos, sin))
                else:
                    t_k, t_r = ck.bench(kernel), ck.bench(ref)
                ck.rows.append([label, name, str(t), f"{rel(out, expected):.1e}", str(not_equal), us(t_k), us(t_r),
                                f"{t_r / t_k:.1f}x", f"{nbytes / t_k / 1e3:.0f}"])  # fmt: skip
    ck.table("elementwise kernels", ["kernel", "dtype", "tokens", "err", "!= elems", "triton us", "torch us", "speedup", "GB/s"])


def check_gemv(ck: Checker, sz: Sizes) -> None:
    """The batch-1 GEMV, plain and with the MLP's SiLU fused in, at the model's weight
    shapes: its error against float32 sums must stay within a few times cuBLAS's own."""
    from shared.model.kernels import activation
    from shared.model.kernels.gemv import gemv

    qkv = (sz.heads + 2 * sz.kv_heads) * sz.head_dim
    shapes = [("qkv_proj", qkv, sz.hidden, False), ("o_proj", sz.hidden, sz.heads * sz.head_dim, False),
              ("gate_up_proj", 2 * sz.intermediate, sz.hidden, False), ("down_proj + silu", sz.hidden, sz.intermediate, True)]  # fmt: skip
    for name, dtype in ck.dtypes.items():
        for label, n, k, gated in shapes:
            x = torch.randn(1, 2 * k if gated else k, device=ck.device, dtype=dtype)
            w = (torch.randn(n, k, device=ck.device) * k**-0.5).to(dtype)
            act = activation.silu_and_mul(x[:, :k], x[:, k:]) if gated else x
            out = gemv(x, w, gated=gated)
            exact = torch.nn.functional.linear(act.float(), w.float())
            ref = torch.nn.functional.linear(act, w)
            err, torch_err = rel(out, exact), rel(ref, exact)
            if err > max(4 * torch_err, 1e-5 if dtype == torch.float32 else 4e-3):
                ck.fail(f"gemv {label} {name}: error {err:.1e} against cuBLAS's {torch_err:.1e}")
            t_k = ck.bench(lambda: gemv(x, w, gated=gated))  # noqa: B023
            t_r = ck.bench(lambda: torch.nn.functional.linear(act, w))  # noqa: B023
            ck.rows.append([label, name, f"{n}x{k}", f"{err:.1e}", f"{torch_err:.1e}", us(t_k), us(t_r),
                            f"{t_r / t_k:.2f}x", f"{w.nbytes / t_k / 1e3:.0f}"])  # fmt: skip
    ck.table("batch-1 GEMV (us per call; GB/s of weight read)",
             ["matmul", "dtype", "shape", "err", "cuBLAS err", "triton us", "cuBLAS us", "speedup", "GB/s"])  # fmt: skip


def check_model(ck: Checker, sz: Sizes) -> None:
    """A 2-layer model of these dimensions, kernels="triton" against kernels="torch":
    varlen prefill then greedy decode steps; then one decode step timed."""
    from shared.model.config import ModelConfig
    from shared.model.forward_batch import AttentionMetadata
    from shared.model.models import build_model

    config = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=sz.hidden, intermediate_size=sz.intermediate,
        num_hidden_layers=2, num_attention_heads=sz.heads, num_key_value_heads=sz.kv_heads, head_dim=sz.head_dim,
        vocab_size=32000 if not ck.tiny else 256, max_position_embeddings=16384, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
    ))  # fmt: skip
    bs = sz.block_size
    for name, dtype in ck.dtypes.items():
        models = {k: build_model(config, dtype=dtype, device=ck.device, kernels=k) for k in ("torch", "triton")}
        g = torch.Generator(device=ck.device).manual_seed(0)
        for p in models["torch"].parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=ck.device) * (0.1 if p.dim() == 1 else 0.02) + (p.dim() == 1))
        models["triton"].load_state_dict(models["torch"].state_dict())
        lens = list(sz.model_prompts)
        max_blocks = -(-(max(lens) + 8) // bs)
        tables = torch.arange(len(lens) * max_blocks, device=ck.device).view(len(lens), max_blocks).flip(0).contiguous()
        caches = {k: m.allocate_kv_cache(len(lens) * max_blocks, bs, dtype, ck.device) for k, m in models.items()}
        ids = {k: [torch.randint(0, config.vocab_size, (n,), generator=g, device=ck.device).tolist() for n in lens] for k in models}
        ids["triton"] = [list(x) for x in ids["torch"]]
        step_new = {k: [list(x) for x in ids["torch"]] for k in models}
        pos0 = [0] * len(lens)
        worst, agree, total = 0.0, 0, 0
        for step in range(4):
            logits = {}
            for k, m in models.items():
                new = step_new[k]
                flat = [t for seq in new for t in seq]
                positions = [pos0[s] + i for s, seq in enumerate(new) for i in range(len(seq))]
                starts = [0]
                for seq in new:
                    starts.append(starts[-1] + len(seq))
                seq_lens = [pos0[s] + len(seq) for s, seq in enumerate(new)]
                slots = [int(tables[s, p // bs]) * bs + p % bs for s, seq in enumerate(new) for p in range(pos0[s], pos0[s] + len(seq))]
                meta = AttentionMetadata(torch.tensor(slots, device=ck.device), tables, starts, seq_lens, bs)
                hidden = m(torch.tensor(flat, device=ck.device), torch.tensor(positions, device=ck.device), caches[k], [meta])
                logits[k] = m.compute_logits(hidden[torch.tensor(starts[1:], device=ck.device) - 1])
            worst = max(worst, rel(logits["triton"], logits["torch"]))
            nxt = {k: logits[k].argmax(-1).tolist() for k in models}
            agree += sum(a == b for a, b in zip(nxt["triton"], nxt["torch"]))
            total += len(lens)
            pos0 = [pos0[s] + len(step_new["torch"][s]) for s in range(len(lens))]
            # Both continue with the PyTorch path's tokens, so the inputs stay the same.
            step_new = {k: [[t] for t in nxt["torch"]] for k in models}
        limit = 1e-3 if dtype == torch.float32 else 5e-2
        if not worst <= limit:
            ck.fail(f"model {name}: logits differ by {worst:.2e} > {limit:.0e}")
        # One decode step of a batch at its context (the KV contents do not matter for time).
        batch, ctx = sz.model_decode_batch
        blocks = -(-(ctx + 1) // bs)
        dec_tables = torch.arange(batch * blocks, device=ck.device).view(batch, blocks)
        times = {}
        for k, m in models.items():
            cache = m.allocate_kv_cache(batch * blocks, bs, dtype, ck.device)
            meta = AttentionMetadata(dec_tables[:, ctx // bs] * bs + ctx % bs, dec_tables, list(range(batch + 1)), [ctx + 1] * batch, bs,
                                     torch.arange(batch + 1, dtype=torch.int32, device=ck.device),
                                     torch.full((batch,), ctx + 1, dtype=torch.int32, device=ck.device))  # fmt: skip
            x_ids = torch.zeros(batch, dtype=torch.int64, device=ck.device)
            x_pos = torch.full((batch,), ctx, device=ck.device)
            times[k] = ck.bench(lambda: m(x_ids, x_pos, cache, [meta]))
            del cache
        ck.rows.append([name, f"{worst:.1e}", f"{agree}/{total}", f"{batch}x{ctx}", us(times["triton"]), us(times["torch"]),
                        f"{times['torch'] / times['triton']:.1f}x"])  # fmt: skip
        del models, caches
        if ck.device.type == "cuda":
            torch.cuda.empty_cache()
    ck.table("2-layer model, triton vs torch (greedy agreement; one decode forward, us)",
             ["dtype", "logits err", "argmax agree", "decode", "triton us", "torch us", "speedup"])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes; on a CPU, under the Triton interpreter")
    parser.add_argument("--no-sweep", action="store_true", help="skip the num_splits sweep")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 references in float32
    else:
        if not args.tiny:
            print("no CUDA device: run with --tiny to use the Triton interpreter on the CPU", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        device = torch.device("cpu")
    import triton

    sz = TINY if args.tiny else FULL
    ck = Checker(device, args.tiny)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}; torch {torch.__version__}; triton {triton.__version__}; sizes {'tiny' if args.tiny else 'full'}")
    wanted = [s for s in args.only.split(",") if s]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        print(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    sections = {"elementwise": check_elementwise, "gemv": check_gemv, "decode": check_decode, "graph": check_graph,
                "sweep": check_sweep, "prefill": check_prefill, "floor": check_floor, "model": check_model}  # fmt: skip
    torch.manual_seed(0)
    start = time.perf_counter()
    for section in SECTIONS:
        if section not in wanted or (section == "sweep" and args.no_sweep):
            continue
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                sections[section](ck, sz)
        except Exception:  # keep going: one run on the device should report every section
            traceback.print_exc()
            ck.fail(f"section {section} crashed")
        print(f"  ({section}: {time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if ck.failures:
        print(f"{len(ck.failures)} FAILURES:\n  " + "\n  ".join(ck.failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
