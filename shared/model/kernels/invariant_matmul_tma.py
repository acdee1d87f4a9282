"""The invariant matmul's persistent kernel for prefill rows (issue 14): x [M, K] @ weight
[N, K]^T (+ bias) -> out [M, N], each output element's sum done exactly as in
``invariant_matmul._matmul_kernel``, with other loads and another order of the tiles.

What stays (see invariant_matmul's module docstring for why it decides a row's bits):
one fp32 accumulator per output tile, zeroed, then K walked from 0 upwards in the
weight's BLOCK_K steps, one ``tl.dot`` of a [BLOCK_M, BLOCK_K] x tile by a [BLOCK_K,
BLOCK_N] weight tile per step (wgmma m64nNk16 on Hopper: the family keeps BLOCK_M a
multiple of 64 and 4 or 8 warps for these buckets too), then the bias added in fp32 and
one rounding to the output dtype. Rows past M and the K tail past K load zeros, as the
tile kernel's masks do; columns past N load zeros instead of a real column, which only
changes outputs that are never stored.

What changes is only who computes which tile and how the bytes move:
- TMA (Hopper's Tensor Memory Accelerator) copies each x and weight tile into shared
  memory by a tensor descriptor, and stores the output tile the same way: bounds are
  checked by the hardware (zero fill on load, clipping on store), no per-element masks
  or address arithmetic in the loop.
- Persistent: min(NUM_SMS, tiles) programs, each stepping tile_id by NUM_SMS over the
  output tiles in the grouped order (GROUP_M rows of tiles share weight columns in L2),
  so the loads of a program's next tile overlap its current tile's epilogue.

Descriptors are built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``):
the launcher encodes each one into a CUtensorMap passed by value as a kernel parameter,
so there is no device allocation per launch (device-side ``tl.make_tensor_descriptor``
needs a global scratch allocator, ``triton.set_allocator``), a CUDA graph captures the
maps with its buffers' addresses, and Triton's interpreter runs them on the CPU (the CPU
tests do). Their shapes and strides are runtime values, so M is not specialised on here
either.

TMA needs 16-byte aligned base addresses and row strides and a unit last stride, and
this kernel only 16-bit dtypes (wgmma's bf16/fp16): ``tma_ready`` says whether a call
qualifies; ``invariant_matmul`` runs the tile kernel with the same configuration when it
does not (the same sums, so the same bits).

Reference: ``invariant_matmul._matmul_kernel`` (bitwise), ``torch.nn.functional.linear``.
"""

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

if TYPE_CHECKING:
    from shared.model.kernels.invariant_matmul import MatmulConfig

__all__ = ["persistent_matmul", "tile_coords", "tma_ready"]

TMA_DTYPES = (torch.bfloat16, torch.float16)
TMA_ALIGN_BYTES = 16
INTERPRETER_PROGRAMS = 4
"""Programs on the CPU (Triton's interpreter): few, so that each loops over several tiles."""


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether every 2-D tensor can be read or written by TMA: a 16-bit dtype, a 16-byte
    aligned base, unit last stride, a row stride of a multiple of 16 bytes."""
    for t in tensors:
        if t.dtype not in TMA_DTYPES or t.stride(-1) != 1:
            return False
        if t.data_ptr() % TMA_ALIGN_BYTES or (t.stride(0) * t.element_size()) % TMA_ALIGN_BYTES:
            return False
    return True


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def tile_coords(tile_id, num_m, per_group, GROUP_M: tl.constexpr):
    """Output tile tile_id's (row, column) of tiles in the grouped order both invariant
    matmul kernels use: GROUP_M rows of tiles at a time, so that consecutive tiles share
    weight columns in L2."""
    first_m = (tile_id // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % per_group) % group_rows
    pid_n = (tile_id % per_group) // group_rows
    return pid_m, pid_n


# M changes every step: never specialised on (one compiled variant for all M).
@triton.jit(do_not_specialize=["M"])
def _persistent_kernel(
    x_desc,
    w_desc,
    out_desc,
    bias_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
    NUM_SMS: tl.constexpr,
):
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_n
    # The epilogue recomputes its tile from its own counter rather than reusing the
    # loads' coordinates, so that the pipeliner can flatten the two loops and prefetch
    # the next tile's K steps during this tile's store (as Triton's persistent tutorial).
    tile_id_c = start - NUM_SMS
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, num_m, per_group, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # K in one fixed order, BLOCK_K at a time, into one fp32 accumulator per element:
        # the tile kernel's sum (TMA zero-fills the K tail and the rows past M).
        for ki in range(k_tiles):
            x = x_desc.load([off_m, ki * BLOCK_K])
            w = w_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(x, w.T, acc)

        tile_id_c += NUM_SMS
        pid_m, pid_n = tile_coords(tile_id_c, num_m, per_group, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        # TMA clips the rows past M and the columns past N.
        if EPILOGUE_SUBTILE:
            # Two stores of BLOCK_N / 2 columns: half the epilogue's shared memory.
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            out_desc.store([off_m, off_n], left.to(out_desc.dtype))
            out_desc.store([off_m, off_n + BLOCK_N // 2], right.to(out_desc.dtype))
        else:
            out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def persistent_matmul(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, c: "MatmulConfig"
) -> None:
    """out[M, N] = x2[M, K] @ weight[N, K]^T (+ bias) by the persistent kernel with c's
    tiles. The caller (invariant_matmul) has checked shapes and devices, M, N, K > 0, and
    ``tma_ready(x2, weight, out)``."""
    assert tma_ready(x2, weight, out), "TMA needs 16-byte aligned bases and row strides: run the tile kernel"
    m, k = x2.shape
    n = weight.shape[0]
    store_n = c.block_n // 2 if c.epilogue_subtile else c.block_n
    x_desc = TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [c.block_m, c.block_k])
    w_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [c.block_n, c.block_k])
    out_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], [c.block_m, store_n])
    num_sms = _num_sms(x2.device)
    grid = (min(num_sms, triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)),)
    _persistent_kernel[grid](
        x_desc, w_desc, out_desc, weight if bias is None else bias, m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        EPILOGUE_SUBTILE=c.epilogue_subtile, NUM_SMS=num_sms, num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
