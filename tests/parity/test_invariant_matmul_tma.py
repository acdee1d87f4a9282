"""The invariant matmul's persistent TMA kernel (kernels/invariant_matmul_tma.py, issue 14)
on the CPU, under Triton's interpreter (which runs host tensor descriptors): for the same
configuration it gives bitwise the tile kernel's output (M not a multiple of BLOCK_M, N
not a multiple of BLOCK_N, K not a multiple of BLOCK_K, with and without bias, epilogue
whole or in halves, x with a row stride other than K), stays close to F.linear, and a
row keeps its bits between a decode bucket (tile kernel) and a persistent bucket; a call
TMA cannot address (x's rows 2 bytes apart past 16-byte alignment, float32) runs the
tile kernel instead; the family switches its prefill buckets to persistent only behind
``PERSISTENT_PREFILL``, keeping block_k and the decode buckets, and refuses a persistent
decode or float32 bucket.

float16 only: the interpreter gets bf16 wrong silently (see test_kernels); the H200 test
(tests/gpu/test_gpu_invariant_matmul.py) runs the persistent buckets in bf16.

As in test_batch_invariant_triton, the interpreter's dot is swapped for one whose
per-element sum over K does not depend on the element's place in the tile (numpy's
matmul does; tests/helpers/interpreter_dot.py), so that what is compared is the kernels' own
reduction order.

TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os
import re

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.model.kernels import invariant_matmul as im  # noqa: E402
from shared.model.kernels import invariant_matmul_tma as tma  # noqa: E402
from shared.model.kernels.invariant_matmul import DECODE_ROWS, MatmulConfig, MatmulFamily  # noqa: E402

if not isinstance(tma._persistent_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")

pytestmark = pytest.mark.usefixtures("place_free_dot")  # the root conftest's place-free dot, for every test here

LLAMA_WEIGHTS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


class Launches:
    """Counts the launches of both kernels, then launches."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tile: list[tuple[int, int]] = []
        self.persistent: list[tuple[int, int]] = []
        monkeypatch.setattr(im, "_matmul_kernel", self._spy(im._matmul_kernel, self.tile))
        monkeypatch.setattr(tma, "_persistent_kernel", self._spy(tma._persistent_kernel, self.persistent))

    @staticmethod
    def _spy(kernel, record: list[tuple[int, int]]):  # noqa: ANN001, ANN205
        class Spy:
            def __getitem__(self, grid):  # noqa: ANN001, ANN204
                def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                    record.append((kwargs["BLOCK_M"], kwargs["BLOCK_N"]))
                    return kernel[grid](*args, **kwargs)

                return launch

        return Spy()


def _tile(bm: int, bn: int, bk: int, persistent: bool = False, subtile: bool = False) -> MatmulConfig:
    return MatmulConfig(bm, bn, bk, 8, 4, 3, persistent, subtile)


def _data(m: int, n: int, k: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).half()
    b = torch.randn(n, generator=g).half() if bias else None
    return torch.randn(m, k, generator=g).half(), w, b


# (M, N, K, block_k): M no multiple of BLOCK_M (64), N of BLOCK_N (64), K of block_k; a
# program loops over several tiles (4 programs on the CPU), one over a single tile.
SHAPES = [(300, 96, 80, 32), (130, 40, 64, 64), (64, 64, 96, 32)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [True, False])
def test_persistent_kernel_gives_the_tile_kernels_bits(
    shape: tuple[int, int, int, int], with_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, n, k, bk = shape
    x, w, b = _data(m, n, k, with_bias, seed=m + n + k)
    launches = Launches(monkeypatch)
    tiled = im.invariant_matmul(x, w, b, config=_tile(64, 64, bk))
    for subtile in (False, True):
        persistent = im.invariant_matmul(x, w, b, config=_tile(64, 64, bk, persistent=True, subtile=subtile))
        assert torch.equal(persistent, tiled), (shape, subtile, int((persistent != tiled).sum()))
    assert launches.tile == [(64, 64)] and launches.persistent == [(64, 64)] * 2
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(tiled.double(), ref, rtol=1e-2, atol=1e-2)
    # x with rows 88 elements apart (176 bytes: still TMA-addressable), not K.
    wide = torch.zeros(m, k + 8, dtype=x.dtype)
    wide[:, :k] = x
    assert torch.equal(im.invariant_matmul(wide[:, :k], w, b, config=_tile(64, 64, bk, persistent=True)), tiled)
    assert len(launches.persistent) == 3


def test_a_row_keeps_its_bits_from_the_decode_bucket_to_a_persistent_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small family: the tile kernel's 64x32 tiles up to DECODE_ROWS, the persistent
    kernel's 64x64 above (K = 200: seven K steps, the last short); M = 300 rows against
    M = 1, 3, 128 and 130 at several offsets."""
    family = MatmulFamily(32, (DECODE_ROWS,), (_tile(64, 32, 32), _tile(64, 64, 32, persistent=True)))
    monkeypatch.setattr(im, "matmul_family", lambda n, k, dtype: family)
    launches = Launches(monkeypatch)
    x, w, b = _data(300, 136, 200, bias=True, seed=5)
    full = im.invariant_matmul(x, w, b)
    assert launches.persistent == [(64, 64)] and launches.tile == []
    for m, start in [(1, 0), (1, 77), (3, 299 - 3), (128, 5), (130, 0), (130, 31)]:
        assert torch.equal(im.invariant_matmul(x[start : start + m], w, b), full[start : start + m]), (m, start)
    assert len(launches.tile) == 4 and len(launches.persistent) == 3  # 1, 1, 3, 128 rows; 300, 130, 130


def test_calls_tma_cannot_address_run_the_tile_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = Launches(monkeypatch)
    x, w, b = _data(70, 40, 64, bias=True, seed=7)
    tiled = im.invariant_matmul(x, w, b, config=_tile(64, 64, 32))
    # Rows 65 elements (130 bytes) apart: not a multiple of 16 bytes.
    odd = torch.zeros(70, 65, dtype=x.dtype)
    odd[:, :64] = x
    assert not tma.tma_ready(odd[:, :64])
    assert torch.equal(im.invariant_matmul(odd[:, :64], w, b, config=_tile(64, 64, 32, persistent=True)), tiled)
    # A base 2 bytes past a 16-byte boundary.
    flat = torch.zeros(70 * 64 + 1, dtype=x.dtype)
    shifted = flat[1:].view(70, 64)
    shifted.copy_(x)
    assert not tma.tma_ready(shifted)
    assert torch.equal(im.invariant_matmul(shifted, w, b, config=_tile(64, 64, 32, persistent=True)), tiled)
    # float32: IEEE products, not TMA's 16-bit path.
    out = im.invariant_matmul(x.float(), w.float(), b.float(), config=_tile(64, 64, 32, persistent=True))
    assert torch.equal(out, im.invariant_matmul(x.float(), w.float(), b.float(), config=_tile(64, 64, 32)))
    assert launches.persistent == [] and len(launches.tile) == 5


@pytest.fixture
def persistent_prefill(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(im, "PERSISTENT_PREFILL", True)
    im.matmul_family.cache_clear()
    yield
    monkeypatch.undo()
    im.matmul_family.cache_clear()


def test_families_without_the_switch_keep_the_tile_kernel() -> None:
    assert im.PERSISTENT_PREFILL is None  # on where the device has TMA (the H200 sweep chose the tiles)...
    assert im.persistent_prefill() is False  # ... so off here, without CUDA
    for n, k in LLAMA_WEIGHTS:
        assert not any(c.persistent for c in im.matmul_family(n, k, torch.bfloat16).configs), (n, k)


def test_persistent_prefill_changes_only_the_prefill_buckets(persistent_prefill: None) -> None:
    for (n, k), name in zip(LLAMA_WEIGHTS, ["qkv", "o", "gate_up", "down", "logits"]):
        family = im.matmul_family(n, k, torch.bfloat16)  # as invariant_matmul asks, the switch on
        assert family == im.matmul_family(n, k, torch.bfloat16, persistent=True)
        tiled = im.matmul_family(n, k, torch.bfloat16, persistent=False)
        first = im.PERSISTENT_TILES[name][0][0]
        assert family.block_k == tiled.block_k and first >= DECODE_ROWS
        for m in (1, 2, DECODE_ROWS, first):  # decode and every M up to the first edge: as before
            assert family.config(m) == tiled.config(m), (name, m)
        for edge, (bm, bn, w, s, sub) in im.PERSISTENT_TILES[name]:
            assert family.config(edge + 1) == MatmulConfig(bm, bn, family.block_k, 8, w, s, True, sub), (name, edge)
        assert family.config(8192).persistent and not family.config(first).persistent
        assert not any(c.persistent for c in im.matmul_family(n, k, torch.float32).configs)


def test_family_refuses_persistent_decode_float32_and_oversized_buckets() -> None:
    decode, prefill = _tile(64, 64, 64), MatmulConfig(128, 128, 64, 8, 8, 3, persistent=True)
    MatmulFamily(64, (DECODE_ROWS,), (decode, prefill))  # the allowed shape
    with pytest.raises(AssertionError):  # a persistent bucket serving decode rows
        MatmulFamily(64, (64, DECODE_ROWS), (decode, prefill, prefill))
    with pytest.raises(AssertionError):  # persistent float32 (no TMA, no wgmma)
        MatmulFamily(64, (DECODE_ROWS,), (decode, prefill), tensor_cores=False)
    with pytest.raises(AssertionError):  # another block_k: another reduction order
        MatmulFamily(64, (DECODE_ROWS,), (decode, MatmulConfig(128, 128, 128, 8, 8, 2, persistent=True)))
    with pytest.raises(AssertionError):  # 4 stages of 128x256x64 and a whole 128x256 epilogue: over 227 KB
        MatmulFamily(64, (DECODE_ROWS,), (decode, MatmulConfig(128, 256, 64, 8, 8, 4, persistent=True)))
    # ... which the halved epilogue brings within it.
    MatmulFamily(64, (DECODE_ROWS,), (decode, MatmulConfig(128, 256, 64, 8, 8, 4, True, True)))
    with pytest.raises(AssertionError):  # an epilogue subtile on the tile kernel means nothing
        MatmulFamily(64, (DECODE_ROWS,), (decode, MatmulConfig(128, 128, 64, 8, 8, 3, False, True)))


def test_the_sweeps_persistent_candidates_are_buckets_a_family_accepts() -> None:
    """tools/bench/batch_invariant_bench.py --persistent-sweep times only tiles that
    PERSISTENT_TILES could take: each weight's block_k, wgmma, TMA's box, 227 KB."""
    from tools.bench.batch_invariant_bench import persistent_candidates

    for block_k, count in [(64, 7), (128, 1)]:
        candidates = persistent_candidates(block_k)
        assert len(candidates) == count and len(set(candidates)) == count, [str(c) for c in candidates]
        for c in candidates:
            MatmulFamily(block_k, (DECODE_ROWS,), (_tile(64, 64, block_k), c))
            assert c.persistent and c.num_warps == 8 and 3 <= c.num_stages <= 5


SM90_COMPILE = r"""
import json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shared.model.kernels import invariant_matmul as im, invariant_matmul_tma as tma
from tools.bench.batch_invariant_bench import persistent_candidates

configs = set(persistent_candidates(64) + persistent_candidates(128))
for n, k in json.loads(sys.argv[1]):
    configs |= {c for c in im.matmul_family(n, k, torch.bfloat16, persistent=True).configs if c.persistent}
for c in sorted(configs, key=str):
    store_n = c.block_n // 2 if c.epilogue_subtile else c.block_n
    sig = {"x_desc": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>",
           "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
           "out_desc": f"tensordesc<bf16[{c.block_m}, {store_n}]>",
           "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    consts = dict(HAS_BIAS=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                  EPILOGUE_SUBTILE=c.epilogue_subtile, NUM_SMS=132)
    sig |= {name: "constexpr" for name in consts}
    compiled = triton.compile(ASTSource(tma._persistent_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    ptx = compiled.asm["ptx"]
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx)))
    print(json.dumps({"config": str(c), "shared": compiled.metadata.shared, "estimate": c.shared_memory_bytes,
                      "wgmma": wgmma, "tma": "cp.async.bulk.tensor" in ptx, "mma_sync": "mma.sync" in ptx}))
"""


def test_persistent_tiles_compile_for_hopper_on_wgmma_and_tma() -> None:
    """No GPU needed: Triton compiles the persistent kernel for sm_90 on the CPU (its
    wheel carries ptxas). Each sweep candidate and PERSISTENT_TILES tile (with bias)
    issues only wgmma m64nNk16 bf16 into fp32, loads by TMA, no mma.sync, and uses the
    shared memory MatmulConfig estimates (Hopper's 227 KB bound), within barriers' bytes."""
    import json
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SM90_COMPILE, json.dumps(LLAMA_WEIGHTS)], env=env, cwd=os.getcwd(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) >= 8
    for r in results:
        assert r["wgmma"] and all(re.fullmatch(r"m64n\d+k16\.f32\.bf16\.bf16", w) for w in r["wgmma"]), r
        assert r["tma"] and not r["mma_sync"], r
        assert r["estimate"] <= r["shared"] <= min(r["estimate"] + 1024, im.SHARED_MEMORY_BYTES), r
