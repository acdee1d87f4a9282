"""Batch-invariant mode's Triton table (issue 14, point 3) on the CPU, under Triton's
interpreter: the invariant matmul gives a row the same bits whatever batch it is in
(M = 1, 3, 17, 64, 130, at any offset, across its M buckets: the decode tiles up to
M = 128, the prefill tiles above, one block_k) and stays close to F.linear; a
weight's family picks other tiles for small and large M with one block_k; the invariant
attention gives a query token the same bits alone, chunked differently and inside
mixed decode / prefill batches (plain, sliding window with a key floor, sinks), and
stays close to the PyTorch reference; the routed experts (issue 28: the fused MoE one
pair per row at one block size, choices added in order) give a token the same bits
alone and among others; the engine on a tiny model with
kernels="triton" and batch_invariant=True returns one request's logprobs bitwise
equal alone and inside a chunked, mixed batch.

The interpreter's ``tl.dot`` is numpy's matmul, i.e. OpenBLAS, whose result for a row
depends on where the row sits in the product (its micro-kernels treat the edges of a
matrix differently: a row moved from place 31 to place 0 of a 32-row product changes
in the last bit). A tensor-core tile product has no such dependence: every element's
sum runs through the same MMA instructions. So this module swaps the interpreter's
dot for a product whose per-element sum does not depend on the row's place
(tests/helpers/interpreter_dot.py): what these tests check is the kernels' own logic (one tile
configuration for every M, K and KV tiles in one order, no batch-chosen splits, one
code path per key); tests/gpu/test_gpu_batch_invariant.py checks the hardware's part.

TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.engine.llm import LLM  # noqa: E402
from shared.engine.sampling_params import SamplingParams  # noqa: E402
from shared.model import batch_invariant  # noqa: E402
from shared.model.kernels import invariant_attention as ia  # noqa: E402
from shared.model.kernels import invariant_matmul as im  # noqa: E402
from shared.model.kernels.invariant_matmul import (  # noqa: E402
    DECODE_ROWS,
    MatmulConfig,
    MatmulFamily,
    invariant_matmul,
    matmul_config,
    matmul_family,
)
from shared.model.kernels.paged_decode import paged_decode_attention  # noqa: E402
from shared.model.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from shared.model.kernels.reference import paged_attention_ref  # noqa: E402
from shared.model.loader import load_model  # noqa: E402
from shared.model.moe import Experts  # noqa: E402
from shared.model.moe_config import MoEConfig  # noqa: E402
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model  # noqa: E402

if not isinstance(ia._invariant_attention_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")

pytestmark = pytest.mark.usefixtures("place_free_dot")  # the root conftest's place-free dot, for every test here


# ---------------------------------------------------------------- experts


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_experts_give_a_token_the_same_bits_alone_and_among_others(activation: str) -> None:
    moe = MoEConfig(4, 2, 32, "softmax_topk", expert_bias=activation == "gpt_oss", activation=activation,
                    swiglu_limit=0.5 if activation == "gpt_oss" else None)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    experts = Experts(32, moe, torch.float32, torch.device("cpu"))
    for p in experts.parameters():
        p.copy_(0.2 * torch.randn(p.shape, generator=g))
    reference_path = experts.select(torch.arange(4))  # the PyTorch path, before the kernel goes in
    batch_invariant.install(experts, batch_invariant.invariant_ops(triton=True))
    x = torch.randn(19, 32, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(19)])
    weights = torch.rand(19, 2, generator=g)
    full = experts(x, ids, weights)
    torch.testing.assert_close(full, reference_path(x, ids, weights), rtol=1e-4, atol=1e-5)
    for start, num in [(0, 1), (7, 1), (3, 9), (18, 1)]:
        part = slice(start, start + num)
        assert torch.equal(experts(x[part], ids[part], weights[part]), full[part]), (start, num)


# ---------------------------------------------------------------- matmul


class LaunchSpy:
    """Stands in for the matmul kernel: records each launch's tile settings, then launches."""

    KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")

    def __init__(self, kernel) -> None:  # noqa: ANN001
        self.kernel = kernel
        self.launches: list[tuple[int, ...]] = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.launches.append(tuple(kwargs[k] for k in self.KEYS))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _launched(c: MatmulConfig) -> tuple[int, ...]:
    return (c.block_m, c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_gives_a_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, with_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = LaunchSpy(im._matmul_kernel)
    monkeypatch.setattr(im, "_matmul_kernel", spy)
    g = torch.Generator().manual_seed(1)
    # K = 80: not a multiple of the float32 BLOCK_K (32), so the masked K tail runs too.
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(300, 80, generator=g).to(dtype)
    full = invariant_matmul(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol)
    for m in (1, 3, 17, 64, 130, 257):
        for start in sorted({0, 1, 31, 300 - m}):
            if start + m <= 300:
                assert torch.equal(invariant_matmul(x[start : start + m], w, b), full[start : start + m]), (m, start)
    # Amid other rows: a row among strangers, at another place in its tile.
    strangers = torch.randn(40, 80, generator=g).to(dtype)
    mixed = invariant_matmul(torch.cat([strangers[:7], x[100:101], strangers[7:]]), w, b)
    assert torch.equal(mixed[7], full[100])
    # M = 257 and 300 ran the largest tiles, 130 the middle ones, the rest the decode tiles
    # (float16), with one block_k.
    family = matmul_family(96, 80, dtype)
    assert set(spy.launches) == {_launched(c) for c in family.configs}
    assert len(family.configs) == (1 if dtype == torch.float32 else 3)


def test_matmul_family_picks_tiles_by_m_with_one_block_k() -> None:
    """Each Llama-3-8B weight in bf16: other tiles for decode and prefill rows, in ranges
    of M that change tiles at each edge, one block_k; float32 one configuration; a family mixing block_k or
    leaving wgmma's conditions is refused."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        family = matmul_family(n, k, torch.bfloat16)
        small, large = matmul_config(n, k, torch.bfloat16, 1), matmul_config(n, k, torch.bfloat16, 8192)
        assert (small.block_m, small.block_n) != (large.block_m, large.block_n), (n, k)
        assert {c.block_k for c in family.configs} == {family.block_k}
        # Each edge splits two different tiles; a decode step never reaches the largest.
        for edge, below, above in zip(family.edges, family.configs, family.configs[1:]):
            assert below != above and matmul_config(n, k, torch.bfloat16, edge) == below
            assert matmul_config(n, k, torch.bfloat16, edge + 1) == above
        assert family.edges[-1] >= DECODE_ROWS
        assert matmul_config(n, k, torch.float16, 8192) == large
        assert matmul_config(n, k, torch.float32, 1) == matmul_config(n, k, torch.float32, 8192)
    decode = MatmulConfig(64, 64, 128, 8, 4, 6)
    with pytest.raises(AssertionError):  # prefill tiles of another block_k: another reduction order
        MatmulFamily(128, (DECODE_ROWS,), (decode, MatmulConfig(128, 128, 64, 8, 8, 3)))
    with pytest.raises(AssertionError):  # 32-row tiles: mma.sync, not wgmma
        MatmulFamily(128, (DECODE_ROWS,), (decode, MatmulConfig(32, 128, 128, 8, 4, 3)))
    with pytest.raises(AssertionError):  # 4 stages of 128x128x128: more shared memory than Hopper has
        MatmulFamily(128, (DECODE_ROWS,), (decode, MatmulConfig(128, 128, 128, 8, 8, 4)))


def test_matmul_keeps_leading_dims_and_checks_its_arguments() -> None:
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(24, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    out = invariant_matmul(x, w)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out.reshape(6, 24), invariant_matmul(x.reshape(6, 16), w))
    assert invariant_matmul(x[:0], w).shape == (0, 3, 24)
    with pytest.raises(ValueError, match="features"):
        invariant_matmul(torch.randn(3, 15), w)
    with pytest.raises(ValueError, match="bias"):
        invariant_matmul(x, w, torch.randn(23))


# ---------------------------------------------------------------- attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
TARGET_LEN = 45  # more than one 32-key tile and several 16-query tiles (float32: BLOCK_M 32, GROUP 2)


class Cache:
    """A paged cache whose sequences' K/V are all written up front; a step's queries
    attend to the first seq_len keys of their sequence, as after a real step."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        perm = torch.randperm(sum(blocks) + 3, generator=g).tolist()  # blocks scattered, not in order
        self.tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        taken = 0
        for s, n in enumerate(blocks):
            self.tables[s, :n] = torch.tensor(perm[taken : taken + n])
            taken += n
        self.kv = torch.randn(2, len(perm), BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
        self.q = [torch.randn(n, HEADS, HEAD_DIM, generator=g) for n in lengths]
        self.sinks = torch.randn(HEADS, generator=g)

    def run(self, chunks: list[tuple[int, int, int]], window: int | None, floor: list[int] | None, sinks: bool):
        """chunks: (sequence, first query, end) -> each chunk's output [end - first, H, D]."""
        query = torch.cat([self.q[s][a:e] for s, a, e in chunks])
        starts = torch.tensor([0] + [e - a for _, a, e in chunks]).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([e for _, _, e in chunks], dtype=torch.int32)
        tables = self.tables[[s for s, _, _ in chunks]]
        key_floor = None if floor is None else torch.tensor([floor[s] for s, _, _ in chunks], dtype=torch.int32)
        out = ia.invariant_attention(query, self.kv, starts, seq_lens, tables, HEAD_DIM**-0.5, window, key_floor,
                                     self.sinks if sinks else None)  # fmt: skip
        return list(out.split([e - a for _, a, e in chunks]))


VARIANTS = {
    "causal": dict(window=None, floor=None, sinks=False),
    "window_floor": dict(window=7, floor=[0, 3, 0, 12], sinks=False),
    "sinks": dict(window=None, floor=None, sinks=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_gives_a_token_the_same_bits_alone_chunked_and_in_mixed_batches(variant: str) -> None:
    v = VARIANTS[variant]
    cache = Cache([20, TARGET_LEN, 33, 9], seed=3)
    T = 1  # the target sequence
    alone = cache.run([(T, 0, TARGET_LEN)], **v)[0]
    # Close to the PyTorch reference (the model's CPU path), every query of the prompt.
    key_floor = None if v["floor"] is None else [v["floor"][T]]
    ref = paged_attention_ref(cache.q[T], cache.kv, [0, TARGET_LEN], [TARGET_LEN], cache.tables[[T]], v["window"],
                              HEAD_DIM**-0.5, key_floor, cache.sinks if v["sinks"] else None)  # fmt: skip
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)
    # Chunked two ways, each chunk a step of its own.
    for cuts in ([0, 8, 16, 29, TARGET_LEN], [0, 1, 2, 17, 44, TARGET_LEN]):
        parts = [cache.run([(T, a, e)], **v)[0] for a, e in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), alone), cuts
    # Mixed steps: decodes of the others around a chunk of the target, then the target decoding among prefills.
    step = cache.run([(0, 19, 20), (T, 5, 30), (2, 32, 33), (3, 0, 9)], **v)
    assert torch.equal(step[1], alone[5:30])
    step = cache.run([(2, 0, 33), (T, 44, 45), (0, 3, 20)], **v)
    assert torch.equal(step[1], alone[44:45])
    decodes = cache.run([(0, 19, 20), (T, 30, 31), (2, 32, 33), (3, 8, 9)], **v)
    assert torch.equal(decodes[1], alone[30:31])


def test_the_normal_kernels_change_a_tokens_bits_with_the_step() -> None:
    """What the test above would catch: the normal path's decode kernel (keys split into
    parts merged after) and its prefill kernel give the same decode token other bits."""
    cache = Cache([20, TARGET_LEN, 33, 9], seed=3)
    scale = HEAD_DIM**-0.5
    q = cache.q[1][TARGET_LEN - 1 :]
    seq_lens, tables = torch.tensor([TARGET_LEN], dtype=torch.int32), cache.tables[[1]]
    decode = paged_decode_attention(q, cache.kv, seq_lens, tables, scale, num_splits=3, block_n=16)
    prefill = paged_prefill_attention(q, cache.kv, torch.tensor([0, 1], dtype=torch.int32), seq_lens, tables, 1, scale)
    torch.testing.assert_close(decode, prefill, rtol=1e-5, atol=1e-5)
    assert not torch.equal(decode, prefill)


# ---------------------------------------------------------------- engine

TARGET = random_prompts([37], vocab=500, seed=77)[0]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
ENGINE = dict(kernels="triton", batch_invariant=True, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("bit")))


def test_the_build_installs_the_triton_table_only_where_it_runs(model: str) -> None:
    triton_model = load_model(model, kernels="triton", batch_invariant=True)
    assert triton_model._gemv is invariant_matmul and triton_model._triton_attention is ia
    assert triton_model.model.layers[0].self_attn.qkv_proj._gemv is invariant_matmul
    torch_model = load_model(model, kernels="torch", batch_invariant=True)  # the plain CPU: the PyTorch table
    assert torch_model._gemv is batch_invariant.invariant_linear and not torch_model.use_triton


def test_engine_logprobs_bitwise_equal_alone_and_in_a_chunked_mixed_batch(model: str) -> None:
    alone = LLM(model, **ENGINE).generate([TARGET], PARAMS)[0]
    assert len(alone.logprobs) == 4 and len(alone.logprobs[0].top) == 5
    # Another reduction order, the same function: close to the PyTorch path's numbers.
    normal = LLM(model, kernels="torch").generate([TARGET], PARAMS)[0]
    assert alone.token_ids == normal.token_ids
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(alone.logprobs, normal.logprobs))
    llm = LLM(model, block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24, **ENGINE)
    prompts = random_prompts([5, 23, 1, 12], vocab=500, seed=5)
    params = [SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True) for i in range(4)]
    prompts.insert(2, TARGET)
    params.insert(2, PARAMS)
    out = llm.generate(prompts, params)[2]
    assert (out.token_ids, out.logprobs) == (alone.token_ids, alone.logprobs)
