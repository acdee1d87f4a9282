"""Batch-invariant matmul: x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], one Triton
GEMM whose result for a row does not depend on M or on the other rows.

Why a row's bits can change with the batch in a library GEMM: the library picks a
kernel, tile shape and split-K from M (a GEMV for one row, split-K for few rows,
larger tiles for many), and each choice sums the K products in another order.

What decides a row's bits here is only how each output element's sum over K is done:
one program's fp32 accumulator walks K in BLOCK_K steps from 0 upwards (no split-K, no
atomics), and each step is one ``tl.dot`` of a [BLOCK_M, BLOCK_K] by [BLOCK_K,
BLOCK_N] tile, which the compiler issues as BLOCK_K / 16 tensor-core instructions of
one family chained in K order into that accumulator (bf16/fp16 on Hopper: wgmma
m64nNk16, N the tile columns one warpgroup covers). What is assumed of the hardware:
an instruction adds an element's 16 products to its accumulator in a way that
depends neither on the element's row or column in the tile nor on the instruction's
N (the single-configuration kernel already assumed the first). Rows past M load
zeros and are never stored.

So a weight has a *family* of tile configurations (``MatmulFamily``): one BLOCK_K
(and one dot precision) fixed by (N, K, dtype), and one configuration per bucket of
M (decode rows: small tiles that spread the weight over every multiprocessor;
prefill rows: larger tiles that reuse it, in up to four ranges of M per weight),
chosen by M at launch. What differs between
the buckets only decides which program computes which element and how the loads are
pipelined, never an element's sum: BLOCK_M and BLOCK_N (where the element sits in
the tile), GROUP_M (the order of the tiles), num_stages (how far ahead the loads
run) and num_warps (which warps share the tile). The one thing that could change the
sum, the instruction family, is held fixed by construction: every 16-bit bucket has
BLOCK_M a multiple of 64, num_warps a multiple of 4 and BLOCK_N a multiple of 8,
which is when Triton lowers a dot on sm90 to wgmma (a BLOCK_M of 16 or 32, or 2
warps, would fall back to mma.sync, another instruction) -- ``MatmulFamily`` refuses
a bucket that breaks this. float32 keeps one configuration for every M (IEEE
products, no tensor cores). The GPU test tests/gpu/test_gpu_invariant_matmul.py
checks the claim on the H200: for each Llama-3-8B weight in bf16, the first rows of
a large-M call (the prefill bucket) are bitwise those of M = 1 .. 8192 calls across
every bucket edge, and every bucket is used.

A prefill bucket may instead run the persistent kernel (``MatmulConfig.persistent``,
kernels/invariant_matmul_tma.py): TMA loads and stores, one program per multiprocessor
looping over the output tiles, and each tile's sum done as above (same block_k, K from
0 up, one fp32 accumulator, wgmma) -- so its rows are bitwise the tile kernel's. Which
buckets do is ``PERSISTENT_PREFILL`` and ``PERSISTENT_TILES``; a call whose x or output
TMA cannot address (a row stride not a multiple of 16 bytes) runs the tile kernel with
the same configuration.

M is not specialised on (``do_not_specialize``): Triton would otherwise compile a
separate variant for M == 1 and for M divisible by 16, and the same arithmetic in
another compiled variant is an assumption this module does not need to make. Each
bucket compiles once.

Reference: ``torch.nn.functional.linear`` (equal up to the order of the sums).
"""

import bisect
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.model.kernels import invariant_matmul_tma as tma
from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor

__all__ = ["MatmulConfig", "MatmulFamily", "invariant_matmul", "matmul_config", "matmul_family", "persistent_prefill"]

SHARED_MEMORY_BYTES = 227 * 1024
"""Shared memory one program may use on Hopper (H100/H200): the pipeline's stages must fit."""
TMA_BOX = 256
"""The most elements a TMA copy moves along one dimension: the persistent tiles' bound."""
DECODE_ROWS = 128
"""Decode steps run at most this many rows (128 requests, or 32 with 3 drafts each) on
every weight's decode-shaped tiles; the buckets above are prefill's."""


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: bool = False
    """Run by the persistent TMA kernel (invariant_matmul_tma.py) instead of the tile
    kernel: the same sums, other loads; prefill buckets only."""
    epilogue_subtile: bool = False
    """Persistent only: store each output tile as two halves of BLOCK_N / 2 columns (half
    the epilogue's shared memory, room for another stage)."""

    @property
    def shared_memory_bytes(self) -> int:
        """The x and weight tiles of every pipeline stage, in a 16-bit dtype, and for the
        persistent kernel its output tile's staging buffer (TMA stores from shared memory,
        while the next tile's loads are in flight)."""
        stages = self.num_stages * (self.block_m + self.block_n) * self.block_k * 2
        if not self.persistent:
            return stages
        return stages + self.block_m * self.block_n * 2 // (2 if self.epilogue_subtile else 1)

    def __str__(self) -> str:
        kernel = (" tma/2" if self.epilogue_subtile else " tma") if self.persistent else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{kernel}"


@dataclass(frozen=True, slots=True)
class MatmulFamily:
    """A weight's tile configurations: ``configs[i]`` serves M <= ``edges[i]`` (the last
    one every larger M), all with the weight's one ``block_k`` (see the module docstring)."""

    block_k: int
    edges: tuple[int, ...]
    configs: tuple[MatmulConfig, ...]
    tensor_cores: bool = True
    """Whether the dot runs on wgmma (16-bit dtypes); False for float32's IEEE products."""

    def __post_init__(self) -> None:
        assert len(self.configs) == len(self.edges) + 1 and list(self.edges) == sorted(set(self.edges))
        for i, c in enumerate(self.configs):
            assert c.block_k == self.block_k, (c, self.block_k)  # the reduction order is the weight's
            if self.tensor_cores:
                # The wgmma conditions (else Triton falls back to mma.sync: another instruction).
                assert c.block_m % 64 == 0 and c.num_warps % 4 == 0 and c.block_n % 8 == 0, c
                assert c.shared_memory_bytes <= SHARED_MEMORY_BYTES, c
            if c.persistent:
                # 16-bit only (TMA and wgmma), and prefill only: decode's tiles spread the
                # weight over every multiprocessor, one tile each, with nothing to persist.
                assert self.tensor_cores and i > 0 and self.edges[i - 1] >= DECODE_ROWS, (i, c)
                assert c.block_m <= TMA_BOX and c.block_n <= TMA_BOX, c
            else:
                assert not c.epilogue_subtile, c

    def bucket(self, m: int) -> int:
        """Index of the configuration that M rows run with."""
        return bisect.bisect_left(self.edges, m)

    def config(self, m: int) -> MatmulConfig:
        return self.configs[self.bucket(m)]


Tile = tuple[int, int, int, int]
"""(block_m, block_n, num_warps, num_stages)."""
PersistentTile = tuple[int, int, int, int, bool]
"""(block_m, block_n, num_warps, num_stages, epilogue_subtile) of the persistent kernel."""

PERSISTENT_PREFILL: bool | None = None
"""Whether each weight's prefill rows from the first edge of its ``PERSISTENT_TILES`` up
run the persistent TMA kernel: True, False, or None for "where the current CUDA device
has TMA" (compute capability 9.0 or above). ``matmul_family`` caches its answer: whoever
changes this calls ``matmul_family.cache_clear()`` (or asks ``matmul_family(...,
persistent=...)``)."""

PERSISTENT_TILES: dict[str, tuple[tuple[int, PersistentTile], ...]] = {
    "qkv": ((512, (256, 128, 8, 4, True)),),
    "o": ((256, (128, 128, 8, 3, False)),),
    "down": ((256, (128, 128, 8, 3, False)),),
    "gate_up": ((512, (128, 128, 8, 4, False)),),
    "logits": ((1024, (128, 256, 8, 3, False)),),
}
"""Per weight, the persistent kernel's buckets as (the M above which, tile): a tile serves
M above its edge up to the next one's, the last every larger M; the weight's tiles below
the first edge stay. Every tile keeps the weight's block_k (matmul_family's), is on
wgmma (BLOCK_M 128 or 256, 8 warps) and fits Hopper's shared memory with its epilogue
buffer. From the H200 sweep (``batch_invariant_bench --persistent-sweep``,
docs/perf/h200/run19_persistent_sweep.txt): per weight the fastest tile whose rows are
bitwise the tile kernel's, at M = 2048 / 8192 against cuBLAS (the tile kernel's were
1.24-1.42x): qkv 0.97x / 1.00x, o 1.10x / 1.07x, down 1.05x / 0.95x, gate_up 1.03x /
0.92x, logits 1.02x / 0.86x. o and down (block_k 128) have one tile that fits."""


def persistent_prefill() -> bool:
    """``PERSISTENT_PREFILL`` resolved for the current device."""
    if PERSISTENT_PREFILL is not None:
        return PERSISTENT_PREFILL
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _family(
    block_k: int, *buckets: tuple[int, Tile], largest: Tile, persistent: tuple[tuple[int, PersistentTile], ...] = ()
) -> MatmulFamily:
    """Buckets as (the largest M served, tile), then the tile of every larger M; the
    persistent buckets (a weight's ``PERSISTENT_TILES``), if any, replace those above the
    first persistent edge."""
    edges = [edge for edge, _ in buckets]
    configs = [MatmulConfig(bm, bn, block_k, 8, w, s) for bm, bn, w, s in (*(t for _, t in buckets), largest)]
    if persistent:
        first = persistent[0][0]
        kept = bisect.bisect_left(edges, first)  # the buckets wholly below the first persistent edge
        up_to_first = configs[kept]  # what M = first ran with: it still serves up to there
        edges = [*edges[:kept], *(edge for edge, _ in persistent)]
        configs = [*configs[:kept], up_to_first]
        configs += [MatmulConfig(bm, bn, block_k, 8, w, s, True, sub) for _, (bm, bn, w, s, sub) in persistent]
    return MatmulFamily(block_k, tuple(edges), tuple(configs))


@functools.cache
def matmul_family(n: int, k: int, dtype: torch.dtype, persistent: bool | None = None) -> MatmulFamily:
    """The tile configurations of a weight [n, k] in ``dtype``: a function of the weight
    alone, with one block_k; M only picks among them (``MatmulFamily.config``).
    ``persistent``: whether the weight's ``PERSISTENT_TILES`` take over its largest M (on
    the persistent TMA kernel, same block_k); None: ``persistent_prefill()``, read on the
    first call (cached: whoever changes ``PERSISTENT_PREFILL`` calls ``cache_clear()``).

    bf16/fp16, from the H200 sweep over Llama-3-8B's weights (``tools/bench/
    batch_invariant_bench.py --matmul-sweep``, docs/perf/h200/run13_v4_and_sweep.log):
    per weight the block_k that is best over decode and prefill together, then per M
    range the fastest tile of that block_k. Times at M = 1 / 2048 / 8192 against cuBLAS:
    - qkv (n = 6144), block_k 64: 64x128 tiles, 4 warps, 5 stages in decode (1.35x,
      as before), 64x128, 3 stages to M = 512, 128x128, 8 warps, 3 stages above
      (1.25x / 1.19x);
    - o (4096 x 4096), block_k 128 (its decode tiles need it: 1.0x there against 1.1-1.2x
      with 64): 64x64, 6 stages in decode; 64x128, 4 stages to 256; 128x128, 8 warps,
      3 stages above (1.36x / 1.30x);
    - down (4096 x 14336), block_k 128: as o, then 4 warps above M = 2048 (1.16x /
      1.40x / 1.27x);
    - gate_up (n = 28672), block_k 64: 64x128, 4 warps, 3 stages to M = 64 (1.0x),
      128x128, 8 warps, 3 stages to 4096 (1.19x at 2048), 128x256, 4 stages above (1.29x);
    - the logits (n >= 65536), block_k 64: 64x64, 6 stages to M = 32 (0.97-0.99x),
      128x128, 8 warps, 3 stages to 1024, 128x256, 4 stages above.
    float32 runs in IEEE precision (no TF32), like the PyTorch path, in small tiles, one
    configuration for every M."""
    if dtype == torch.float32:
        return MatmulFamily(32, (), (MatmulConfig(32, 64, 32, 8, 4, 2),), tensor_cores=False)
    tiles = PERSISTENT_TILES if (persistent_prefill() if persistent is None else persistent) else {}
    if n >= 65536:
        return _family(64, (32, (64, 64, 4, 6)), (1024, (128, 128, 8, 3)), largest=(128, 256, 8, 4),
                       persistent=tiles.get("logits", ()))  # fmt: skip
    if n >= 16384:
        return _family(64, (64, (64, 128, 4, 3)), (4096, (128, 128, 8, 3)), largest=(128, 256, 8, 4),
                       persistent=tiles.get("gate_up", ()))  # fmt: skip
    if n <= 4096:
        mid = (DECODE_ROWS, (64, 64, 4, 6)), (256, (64, 128, 4, 4))
        if k > 2 * n:  # down_proj's long K: 4 warps hold up better on the largest M
            return _family(128, *mid, (2048, (128, 128, 8, 3)), largest=(128, 128, 4, 3),
                           persistent=tiles.get("down", ()))  # fmt: skip
        return _family(128, *mid, largest=(128, 128, 8, 3), persistent=tiles.get("o", ()))
    return _family(64, (DECODE_ROWS, (64, 128, 4, 5)), (512, (64, 128, 4, 3)), largest=(128, 128, 8, 3),
                   persistent=tiles.get("qkv", ()))  # fmt: skip


def matmul_config(n: int, k: int, dtype: torch.dtype, m: int) -> MatmulConfig:
    """The tile configuration M rows of x run with against a weight [n, k] in ``dtype``."""
    return matmul_family(n, k, dtype).config(m)


# M changes every step: never specialised on (no recompiles, one compiled variant for all M).
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = tma.tile_coords(tl.program_id(0), num_m, GROUP_M * tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M load zeros and are never stored; masked lanes issue no memory traffic,
    # which matters in decode (a 128-row tile of one real row). Columns past N (a weight
    # whose N is no multiple of BLOCK_N) load a real column instead: no mask per element.
    m_ok = rm < M
    rn_load = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn_load[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K in one fixed order, BLOCK_K at a time, into one fp32 accumulator per element.
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = k0 + rk < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, config: MatmulConfig | None = None
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N] in x's dtype, as F.linear,
    with the tile configuration of the weight's family for M = x's rows. ``config``
    overrides it (tuning sweeps only: a caller that changes its block_k between calls
    gives up invariance)."""
    check_device(x.device)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    n, k = weight.shape
    check_tensor("x", x, ndim=x.dim(), dtypes=(weight.dtype,), device=x.device, unit_last_stride=False)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight {tuple(weight.shape)} takes {k}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(weight.dtype,), device=x.device, shape=(n,))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand(m, n))).view(*lead, n)
    c = config or matmul_config(n, k, weight.dtype, m)
    if c.persistent and tma.tma_ready(x2, weight, out):
        tma.persistent_matmul(x2, weight, bias, out, c)
        return out.view(*lead, n)
    # The tile kernel: every other bucket, and a persistent one's call that TMA cannot
    # address (with the same tiles: the same sums, so the same bits).
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _matmul_kernel[grid](
        x2, weight, weight if bias is None else bias, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % c.block_k == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, GROUP_M=c.group_m, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out.view(*lead, n)


invariant_matmul.any_rows = True  # type: ignore[attr-defined]
"""layers.linear hands every input to this row kernel, not only single rows."""
