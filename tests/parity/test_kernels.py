"""The Triton kernels against their PyTorch references, on the CPU under Triton's
interpreter, on fresh seeded random inputs; then a tiny model and the engine with
kernels="triton" against kernels="torch" (the wiring of the switch).

TRITON_INTERPRET must be set before any kernel module is imported: ``triton.jit``
decides at decoration time whether to interpret. Nothing else in the suite imports
the kernel modules (the model imports them only when it selects Triton), so setting
it here, at the top of this module, is enough; the check below fails loudly if not.
bf16 is not tested here: the interpreter gets it wrong silently (tests/gpu does it).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import triton.language  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.engine.config import EngineConfig  # noqa: E402
from shared.engine.llm import LLM  # noqa: E402
from shared.engine.sampling_params import SamplingParams  # noqa: E402
from shared.model.arch_config import RopeConfig  # noqa: E402
from shared.model.attention import write_kv  # noqa: E402
from shared.model.config import ModelConfig  # noqa: E402
from shared.model.kernels import rmsnorm, use_triton_kernels  # noqa: E402
from shared.model.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from shared.model.kernels.paged_decode import choose_num_splits, paged_decode_attention  # noqa: E402
from shared.model.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from shared.model.kernels.reference import paged_attention_ref  # noqa: E402
from shared.model.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from shared.model.kernels.rotary import rotary_embedding_, rotary_embedding_and_store_kv, rotary_ref  # noqa: E402
from shared.model.layers import RotaryEmbedding  # noqa: E402
from shared.model.loader import load_weights  # noqa: E402
from tools.make_model import hf_config_dict  # noqa: E402
from shared.model.interface import CausalLM  # noqa: E402
from tests.helpers.paged_driver import PagedDriver  # noqa: E402
from tests.helpers.numerics import rel_err  # noqa: E402
from shared.model.models import build_model  # noqa: E402

if not isinstance(rmsnorm._rms_norm_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")
if not isinstance(triton.language.cdiv, InterpretedFunction):  # Triton itself, by any module collected earlier
    raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set (a module collected earlier, tests/gpu "
                       "included, imports it at the top): its library functions would not run in the interpreter")

DTYPES = [torch.float32, torch.float16]
# Attention in float16 rounds the output and the softmax weights: about 2 ulps of 1.
ATTN_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
# Elementwise kernels: the float32 sum of squares / exp differ in the last bit, ~1 ulp after rounding.
ELEM_TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- RMSNorm, rotary, SiLU-and-mul -----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (5, 3, 24), (130, 48), (1, 1000)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = gen(hash(shape) % 1000)
    x = torch.randn(shape, generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **ELEM_TOL[dtype])
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **ELEM_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16])  # the interpreter has no bf16
def test_rms_norm_float32_weight_scales_before_the_cast(dtype: torch.dtype) -> None:
    """GPT-OSS's norm: a float32 weight is applied in float32, one rounding at the end."""
    g = gen(7)
    x = (3 * torch.randn(9, 96, generator=g)).to(dtype)
    residual = torch.randn(9, 96, generator=g).to(dtype)
    weight = 1 + 0.1 * torch.randn(96, generator=g)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **ELEM_TOL[dtype])
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **ELEM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (3, 1, 24), (8, 8, 64)])
def test_rotary_equals_reference_exactly(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    g = gen(num_heads * 100 + head_dim)
    # llama3 scaling with a short original context, so all three frequency bands occur.
    rope = RopeConfig("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)  # fmt: skip
    positions = torch.randint(0, 300, (9,), generator=g)
    cos, sin = RotaryEmbedding(rope, head_dim, torch.device("cpu"))(positions, dtype)
    q = torch.randn(9, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(9, num_kv_heads, head_dim, generator=g).to(dtype)
    ref_q, ref_k = rotary_ref(q, k, cos, sin)
    q_out, k_out = rotary_embedding_(q, k, cos, sin)
    assert q_out is q and k_out is k  # in place
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_store_kv_equals_rotary_then_write_kv(dtype: torch.dtype) -> None:
    """The decode path's fused launch: q rotated in place, rotated k and v at their cache
    slots (scattered over blocks, as a block table leaves them), every other slot untouched."""
    g = gen(11)
    num_tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 32, 4
    rope = RopeConfig("default", 10000.0)
    cos, sin = RotaryEmbedding(rope, head_dim, torch.device("cpu"))(torch.randint(0, 100, (num_tokens,), generator=g), dtype)
    # q, k, v as views of one stacked projection, as the model passes them.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    kv_cache = torch.randn(2, 5, block_size, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([17, 2, 9, 3, 12, 0])
    ref_q, ref_k = rotary_ref(q, k, cos, sin)
    ref_cache = kv_cache.clone()
    write_kv(ref_cache, ref_k, v, slots)
    k_before = k.clone()
    out = rotary_embedding_and_store_kv(q, k, v, cos, sin, kv_cache, slots)
    assert out is q and torch.equal(q, ref_q)
    assert torch.equal(kv_cache, ref_cache)
    assert torch.equal(k, k_before)
    with pytest.raises(ValueError, match="kv_cache has dtype"):
        other = torch.float32 if dtype != torch.float32 else torch.bfloat16
        rotary_embedding_and_store_kv(q, k, v, cos, sin, kv_cache.to(other), slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("merged", [False, True])
def test_silu_and_mul(dtype: torch.dtype, merged: bool) -> None:
    g = gen(int(merged))
    if merged:  # the two halves of one [T, 2I] projection: row stride 2I
        x = (3 * torch.randn(6, 2 * 1500, generator=g)).to(dtype)
        gate, up = x[:, :1500], x[:, 1500:]
    else:
        gate, up = (3 * torch.randn(2, 11, 96, generator=g)).to(dtype)
    torch.testing.assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), **ELEM_TOL[dtype])


# -- paged attention ---------------------------------------------------------------


@dataclass
class Paged:
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]


def paged_cache(
    g: torch.Generator, seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> Paged:
    """A random cache whose blocks are handed out shuffled; the table rows are padded with
    block 0, which holds another sequence's data, and one spare column."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in seq_lens) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    for s, n in enumerate(seq_lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = free.pop()
    return Paged(kv_cache, tables, seq_lens)


# name: (heads, kv_heads, head_dim, block_size, seq_lens, window, num_splits, block_n)
DECODE_CASES = {
    "mha": (4, 4, 16, 4, [5, 17, 40], None, 1, 16),
    "gqa4_split3": (8, 2, 32, 16, [1, 33, 70], None, 3, 16),
    "mqa_window_split4": (4, 1, 24, 5, [3, 29, 64], 7, 4, 16),
    "gqa2_window_longer_than_seq": (4, 2, 16, 8, [6, 50], 20, 2, 32),
    "one_long_sequence_many_splits": (6, 2, 16, 16, [200], None, 7, 16),
    "gqa8_auto_splits": (16, 2, 16, 4, [9, 23], None, None, 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_paged_decode(case: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block_size, seq_lens, window, num_splits, block_n = DECODE_CASES[case]
    g = gen(list(DECODE_CASES).index(case))
    paged = paged_cache(g, seq_lens, block_size, kv_heads, head_dim, dtype)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        query, paged.kv_cache, torch.tensor(seq_lens, dtype=torch.int32), paged.block_tables, scale, window,
        num_splits, block_n=block_n,
    )  # fmt: skip
    ref = paged_attention_ref(query, paged.kv_cache, list(range(len(seq_lens) + 1)), seq_lens, paged.block_tables, window, scale)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])


def test_decode_is_the_same_for_any_number_of_splits() -> None:
    g = gen(7)
    paged = paged_cache(g, [100, 3], 16, 2, 16, torch.float32)
    query = torch.randn(2, 4, 16, generator=g)
    seq_lens = torch.tensor([100, 3], dtype=torch.int32)
    outs = [paged_decode_attention(query, paged.kv_cache, seq_lens, paged.block_tables, 0.25, None, n, block_n=16)
            for n in (1, 2, 7)]  # fmt: skip
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-6, atol=1e-6)


def test_decode_of_an_empty_padding_sequence_is_zero() -> None:
    """A CUDA-graph batch padded with sequences of length 0 must not produce NaN."""
    g = gen(8)
    paged = paged_cache(g, [10, 1], 4, 2, 16, torch.float32)
    query = torch.randn(2, 4, 16, generator=g)
    for splits in (1, 3):
        out = paged_decode_attention(
            query, paged.kv_cache, torch.tensor([10, 0], dtype=torch.int32), paged.block_tables, 0.25, None, splits
        )
        assert torch.equal(out[1], torch.zeros_like(out[1])) and not out.isnan().any()


# name: (heads, kv_heads, head_dim, block_size, [(cached prefix, new tokens)], window, block_m, block_n)
PREFILL_CASES = {
    "fresh_prompts_mha": (4, 4, 16, 4, [(0, 7), (0, 12), (0, 1)], None, 16, 16),
    "cached_prefixes_gqa2": (4, 2, 16, 4, [(0, 7), (5, 3), (13, 1), (0, 1), (20, 9)], None, 16, 16),
    "chunks_gqa4_window": (8, 2, 32, 16, [(0, 19), (17, 6), (40, 12)], 6, 32, 16),
    "mqa_head_dim_24_window": (3, 1, 24, 5, [(4, 11), (0, 3), (30, 2)], 9, 16, 32),
    "one_sequence_default_tiles": (4, 2, 16, 8, [(9, 40)], None, None, None),
    "decodes_only": (4, 2, 16, 4, [(9, 1), (0, 1), (30, 1)], 5, None, None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_paged_prefill(case: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block_size, seqs, window, block_m, block_n = PREFILL_CASES[case]
    g = gen(100 + list(PREFILL_CASES).index(case))
    seq_lens = [cached + new for cached, new in seqs]
    paged = paged_cache(g, seq_lens, block_size, kv_heads, head_dim, dtype)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        query, paged.kv_cache, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        paged.block_tables, max(new for _, new in seqs), scale, window, block_m=block_m, block_n=block_n,
    )  # fmt: skip
    ref = paged_attention_ref(query, paged.kv_cache, starts, seq_lens, paged.block_tables, window, scale)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])


# -- key floor (sliding-window replay after a prefix hit) -------------------------


def poison_below_floor(g: torch.Generator, paged: Paged, floors: list[int]) -> None:
    """What a replay leaves below each floor: table entries of whole blocks below it point
    at one scratch block (a block of its own, appended to the cache), and the slots below
    it in the block that holds it are overwritten; both with large random K/V, so that
    reading any of them changes the output by far more than the tolerance."""
    block_size = paged.kv_cache.shape[2]
    shape = (2, 1, *paged.kv_cache.shape[2:])
    scratch = (100 * torch.randn(shape, generator=g)).to(paged.kv_cache.dtype)
    paged.kv_cache = torch.cat([paged.kv_cache, scratch], dim=1)
    scratch_id = paged.kv_cache.shape[1] - 1
    for s, floor in enumerate(floors):
        paged.block_tables[s, : floor // block_size] = scratch_id
        if floor % block_size:
            block = int(paged.block_tables[s, floor // block_size])
            junk = 100 * torch.randn(2, floor % block_size, *paged.kv_cache.shape[3:], generator=g)
            paged.kv_cache[:, block, : floor % block_size] = junk.to(paged.kv_cache.dtype)


def dense_attention(
    query: torch.Tensor, paged: Paged, starts: list[int], window: int | None, scale: float, floors: list[int]
) -> torch.Tensor:
    """The expected output written out: per sequence its keys gathered slot by slot, a
    float64 softmax over j <= p, p - j < window and j >= floor; zeros for a query with no key."""
    heads = query.shape[1]
    block_size, kv_heads = paged.kv_cache.shape[2], paged.kv_cache.shape[3]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, n in enumerate(paged.seq_lens):
        slots = [(int(paged.block_tables[s, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([paged.kv_cache[0, b, o] for b, o in slots]).double()  # [n, kv_heads, D]
        v = torch.stack([paged.kv_cache[1, b, o] for b, o in slots]).double()
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        q = query[starts[s] : starts[s + 1]].double()  # [q_len, heads, D]
        pos = n - q.shape[0] + torch.arange(q.shape[0])
        j = torch.arange(n)
        allowed = (j[None, :] <= pos[:, None]) & (j[None, :] >= floors[s])
        if window is not None:
            allowed &= pos[:, None] - j[None, :] < window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def assert_floor_matters(out: torch.Tensor, no_floor: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double(), expected, **ATTN_TOL[dtype])
    assert (no_floor.double() - expected).abs().max() > 1.0, "the case does not test the floor: ignoring it passes"


# name: (heads, kv_heads, head_dim, block_size, [(cached prefix, new tokens, floor)], window, block_m, block_n)
# A replay from s re-runs tokens s.. with the prefix cached up to s (floor s = cached) or, for
# a later chunk of the replay, further (floor < cached). Floor 0: that sequence has none.
FLOOR_PREFILL_CASES = {
    # Floor 7 in the middle of a block of 4 and of a 16-key tile; window 5 reaches below it
    # for the first queries only, then lies wholly above it.
    "mid_block_window_smaller": (4, 2, 16, 4, [(7, 14, 7)], 5, 16, 16),
    # Floor 16 at a block and tile boundary; window 20 reaches below it for every query.
    "block_boundary_window_larger": (4, 2, 16, 4, [(16, 9, 16)], 20, 16, 16),
    # Several sequences: chunked replay (floor below the cached prefix), one without a floor,
    # a decode row of a mixed batch, a fresh replay, GQA 4, block size 5 (floors mid-block).
    "several_sequences_chunked": (8, 2, 32, 5, [(23, 6, 9), (0, 11, 0), (17, 1, 13), (12, 7, 12)], 12, 32, 16),
    # Queries in several tiles of one sequence, chunked on a cached prefix, the window longer
    # than the whole sequence: only the floor bounds the keys.
    "chunk_window_longer_than_sequence": (4, 4, 16, 8, [(30, 21, 19)], 64, 16, 16),
    # No window: the kernel applies a floor whenever given (masked floor tile, whole tiles
    # above it unmasked); floors mid-tile, at a tile boundary, above some of the queries.
    "no_window": (4, 2, 16, 4, [(40, 9, 19), (33, 8, 32), (10, 8, 14)], None, 16, 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(FLOOR_PREFILL_CASES))
def test_paged_prefill_key_floor(case: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block_size, seqs, window, block_m, block_n = FLOOR_PREFILL_CASES[case]
    g = gen(200 + list(FLOOR_PREFILL_CASES).index(case))
    seq_lens = [cached + new for cached, new, _ in seqs]
    floors = [floor for _, _, floor in seqs]
    paged = paged_cache(g, seq_lens, block_size, kv_heads, head_dim, dtype)
    poison_below_floor(g, paged, floors)
    starts = [0]
    for _, new, _ in seqs:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5

    def run(key_floor: torch.Tensor | None) -> torch.Tensor:
        return paged_prefill_attention(
            query, paged.kv_cache, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            paged.block_tables, max(new for _, new, _ in seqs), scale, window, key_floor, block_m=block_m, block_n=block_n,
        )  # fmt: skip

    expected = dense_attention(query, paged, starts, window, scale, floors)
    assert_floor_matters(run(torch.tensor(floors, dtype=torch.int32)), run(None), expected, dtype)
    ref = paged_attention_ref(query, paged.kv_cache, starts, seq_lens, paged.block_tables, window, scale, floors)
    torch.testing.assert_close(ref.double(), expected, **ATTN_TOL[dtype])


# name: (heads, kv_heads, head_dim, block_size, seq_lens, floors, window, num_splits, block_n)
FLOOR_DECODE_CASES = {
    # Floors mid-block and mid-tile; one sequence without; 3 splits over what is left.
    "window_mid_block_split3": (4, 2, 16, 4, [30, 45, 12], [22, 0, 9], 12, 3, 16),
    # Floors at block and tile boundaries, window longer than the distance to them; 4 splits.
    "window_boundary_split4": (8, 2, 32, 8, [60, 41], [32, 16], 40, 4, 16),
    # Window shorter than the distance (the floor changes nothing there) beside one it bounds,
    # and a floor at the query itself (its own key only); many splits of a short range.
    "window_shorter_and_floor_at_query": (4, 1, 24, 5, [50, 33, 20], [3, 26, 19], 9, 5, 16),
    # No window: the floor alone bounds the keys, one split and several.
    "no_window_split1": (4, 4, 16, 4, [37, 18], [13, 4], None, 1, 16),
    # Three tiles left above the floor over six splits: some splits get nothing.
    "no_window_split6": (4, 4, 16, 4, [58, 18], [21, 4], None, 6, 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(FLOOR_DECODE_CASES))
def test_paged_decode_key_floor(case: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block_size, seq_lens, floors, window, num_splits, block_n = FLOOR_DECODE_CASES[case]
    g = gen(300 + list(FLOOR_DECODE_CASES).index(case))
    paged = paged_cache(g, seq_lens, block_size, kv_heads, head_dim, dtype)
    poison_below_floor(g, paged, floors)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(key_floor: torch.Tensor | None) -> torch.Tensor:
        return paged_decode_attention(
            query, paged.kv_cache, lens, paged.block_tables, scale, window, num_splits, key_floor, block_n=block_n
        )

    starts = list(range(len(seq_lens) + 1))
    expected = dense_attention(query, paged, starts, window, scale, floors)
    out = run(torch.tensor(floors, dtype=torch.int32))
    assert_floor_matters(out, run(None), expected, dtype)
    # The split only changes speed: one split gives the same (int64 floors accepted too).
    one = paged_decode_attention(query, paged.kv_cache, lens, paged.block_tables, scale, window, 1,
                                 torch.tensor(floors), block_n=block_n)  # fmt: skip
    torch.testing.assert_close(one, out, **ATTN_TOL[dtype])
    ref = paged_attention_ref(query, paged.kv_cache, starts, seq_lens, paged.block_tables, window, scale, floors)
    torch.testing.assert_close(ref.double(), expected, **ATTN_TOL[dtype])


def test_decode_key_floor_past_the_query_gives_zeros() -> None:
    """A floor beyond the query (no key left) gives zeros, not NaN, with any split."""
    g = gen(9)
    paged = paged_cache(g, [20, 9], 4, 2, 16, torch.float32)
    query = torch.randn(2, 4, 16, generator=g)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    for splits in (1, 3):
        out = paged_decode_attention(query, paged.kv_cache, lens, paged.block_tables, 0.25, 8, splits,
                                     torch.tensor([25, 0], dtype=torch.int32), block_n=16)  # fmt: skip
        assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


@pytest.mark.parametrize("decode", [False, True])
def test_triton_attend_passes_the_floor_to_sliding_window_layers_only(decode: bool) -> None:
    """plan_triton_attention takes the floor from the metadata (its list, or the runner's
    device tensor); triton_attend applies it for a windowed layer and ignores it for a
    full-attention one, whose cached keys all exist."""
    from shared.model.forward_batch import AttentionMetadata
    from shared.model.kernels.attention import plan_triton_attention, triton_attend

    g = gen(10)
    seqs = [(13, 1, 9), (20, 1, 0)] if decode else [(9, 6, 9), (20, 3, 0), (4, 5, 2)]
    seq_lens = [c + n for c, n, _ in seqs]
    floors = [f for _, _, f in seqs]
    paged = paged_cache(g, seq_lens, 4, 2, 16, torch.float32)
    poison_below_floor(g, paged, floors)
    starts = [0]
    for _, new, _ in seqs:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], 4, 16, generator=g)

    def meta(**floor: object) -> AttentionMetadata:
        return AttentionMetadata(torch.empty(0, dtype=torch.int64), paged.block_tables, starts, seq_lens, 4, **floor)

    no_floor = plan_triton_attention(meta(), 2, 16, torch.device("cpu"))
    assert no_floor.key_floor is None and no_floor.is_decode == decode
    assert plan_triton_attention(meta(key_floor=[0] * len(seqs)), 2, 16, torch.device("cpu")).key_floor is None
    tensor = torch.tensor(floors, dtype=torch.int32)
    assert plan_triton_attention(meta(key_floor=floors, key_floor_tensor=tensor), 2, 16, torch.device("cpu")).key_floor is tensor
    plan = plan_triton_attention(meta(key_floor=floors), 2, 16, torch.device("cpu"))
    assert plan.key_floor is not None and plan.key_floor.tolist() == floors and plan.key_floor.dtype == torch.int32
    windowed = triton_attend(query, paged.kv_cache, plan, 8, 0.25)
    assert_floor_matters(windowed, triton_attend(query, paged.kv_cache, no_floor, 8, 0.25),
                         dense_attention(query, paged, starts, 8, 0.25, floors), torch.float32)  # fmt: skip
    # A full-attention layer reads every key, the garbage below the floor included: as without a floor.
    assert torch.equal(triton_attend(query, paged.kv_cache, plan, None, 0.25),
                       triton_attend(query, paged.kv_cache, no_floor, None, 0.25))  # fmt: skip


def test_choose_num_splits() -> None:
    cpu = torch.device("cpu")  # one "multiprocessor": 4 programs wanted
    assert choose_num_splits(1, 1, 8192, 64, cpu) == 4
    assert choose_num_splits(1, 1, 64, 64, cpu) == 1  # one tile: nothing to split
    assert choose_num_splits(2, 1, 8192, 64, cpu) == 1  # the batch is enough


# -- wrappers reject bad input before launching ----------------------------------


def test_wrappers_raise_value_errors() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(31), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, torch.ones(32, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(32, 4).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(4, 16), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="even"):
        rotary_embedding_(torch.randn(2, 2, 15), torch.randn(2, 1, 15), torch.randn(2, 15), torch.randn(2, 15))
    with pytest.raises(ValueError, match="cos"):
        rotary_embedding_(torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.randn(3, 16), torch.randn(2, 16))
    with pytest.raises(ValueError, match="up"):
        silu_and_mul(torch.randn(3, 8), torch.randn(3, 9))
    paged = paged_cache(gen(0), [5, 6], 4, 2, 16, torch.float32)
    seq_lens = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.randn(2, 3, 16), paged.kv_cache, seq_lens, paged.block_tables, 0.25)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(torch.randn(3, 4, 16), paged.kv_cache, seq_lens, paged.block_tables, 0.25)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(torch.randn(2, 4, 16), paged.kv_cache, seq_lens.float(), paged.block_tables, 0.25)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(torch.randn(2, 4, 16), paged.kv_cache, seq_lens, paged.block_tables[:1], 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(torch.randn(2, 4, 16), paged.kv_cache, seq_lens, paged.block_tables, 0.25, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(torch.randn(5, 4, 16), paged.kv_cache, torch.tensor([0, 5], dtype=torch.int32),
                                seq_lens, paged.block_tables, 5, 0.25)  # fmt: skip
    with pytest.raises(ValueError, match="key_floor"):
        paged_decode_attention(torch.randn(2, 4, 16), paged.kv_cache, seq_lens, paged.block_tables, 0.25, 4, 1,
                               torch.tensor([1, 2, 3], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="key_floor"):
        paged_prefill_attention(torch.randn(11, 4, 16), paged.kv_cache, torch.tensor([0, 5, 11], dtype=torch.int32),
                                seq_lens, paged.block_tables, 6, 0.25, 4, torch.tensor([1.0, 2.0]))  # fmt: skip


# -- the switch, end to end ------------------------------------------------------


def test_switch_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert use_triton_kernels("auto", cpu) is False
    assert use_triton_kernels("torch", cpu) is False
    assert use_triton_kernels("triton", cpu) is True  # under the interpreter
    with pytest.raises(ValueError, match="kernels must be one of"):
        use_triton_kernels("cuda", cpu)
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(model="m", kernels="fast")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        use_triton_kernels("triton", cpu)


# Hidden 64, 2 layers; each case mixes what the kernels must get right.
TINY_MODELS = {
    # GQA 4:2, per-head q/k norm, llama3 rope, a sliding window (6) on layer 1 only.
    "qwen3_window_llama3_rope": dict(
        architectures=["Qwen3ForCausalLM"], head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        use_sliding_window=True, sliding_window=6, layer_types=["full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    # MQA with head_dim 24 (not a power of two), biases everywhere.
    "llama_mqa_head_dim_24_bias": dict(
        architectures=["LlamaForCausalLM"], head_dim=24, num_attention_heads=4, num_key_value_heads=1,
        attention_bias=True, mlp_bias=True,
    ),
}  # fmt: skip


def tiny_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256, max_position_embeddings=256,
             rms_norm_eps=1e-6, **TINY_MODELS[name])  # fmt: skip
    )


def random_weights(model: CausalLM, seed: int) -> dict[str, torch.Tensor]:
    g = gen(seed)
    return {
        name: (1 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name else 0.05 * torch.randn(p.shape, generator=g)
        for name, p in model.checkpoint_tensors().items()
    }


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_model_triton_equals_torch(name: str) -> None:
    """Varlen prefill, chunked prefill mixed with decode, then greedy decode: same logits
    and the same greedy tokens with either kernels setting."""
    config = tiny_config(name)
    models = {k: build_model(config, kernels=k) for k in ("torch", "triton")}
    assert not models["torch"].use_triton and models["triton"].use_triton
    weights = random_weights(models["torch"], seed=3)
    for model in models.values():
        load_weights(model, weights)
    drivers = {k: PagedDriver(m, num_seqs=3, block_size=4, seed=1) for k, m in models.items()}
    g = gen(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 14)]
    steps: list[dict[int, list[int]]] = [
        {0: prompts[0], 1: prompts[1][:6]},  # varlen prefill; sequence 1 chunked
        {1: prompts[1][6:], 0: [7], 2: prompts[2]},  # chunk on a cached prefix, a decode, a new prompt
    ]
    last: dict[str, dict[int, torch.Tensor]] = {}
    for step in steps:
        outs = {k: d.step(step) for k, d in drivers.items()}
        for s in step:
            assert rel_err(outs["triton"][s], outs["torch"][s]) < 1e-5, f"sequence {s}"
        last = outs
    tokens: dict[str, list[list[int]]] = {k: [[] for _ in range(3)] for k in drivers}
    for _ in range(6):  # greedy: each backend feeds its own argmax back
        for k, d in drivers.items():
            nxt = {s: int(last[k][s][-1].argmax()) for s in range(3)}
            for s, t in nxt.items():
                tokens[k][s].append(t)
            last[k] = d.step({s: [t] for s, t in nxt.items()})
        for s in range(3):
            assert rel_err(last["triton"][s], last["torch"][s]) < 1e-5
    assert tokens["triton"] == tokens["torch"]


def test_engine_with_triton_kernels_generates_as_torch(tmp_path: Path) -> None:
    """EngineConfig.kernels reaches the model (through load_model) and the runner's device
    tensors feed the kernels: greedy generation equals the PyTorch path's."""
    preset = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=256, rope_theta=10000.0,
                  tie_word_embeddings=False)  # fmt: skip
    config = hf_config_dict("mistral", preset, "float32", None, None)
    config["sliding_window"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_model(ModelConfig.from_dict(config), kernels="torch")
    save_file(random_weights(model, seed=5), str(tmp_path / "model.safetensors"))
    prompts = [torch.randint(0, 256, (n,), generator=gen(6)).tolist() for n in (13, 6)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for kernels in ("torch", "triton"):
        llm = LLM(str(tmp_path), kernels=kernels, block_size=4, prefill_chunk_size=8, num_kv_blocks=64)
        assert llm.engine.model.use_triton == (kernels == "triton")
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


# -- batch-1 matmul ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(40, 64, False), (37, 100, True), (8, 1024, False)])
def test_gemv_equals_linear(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    from shared.model.kernels.gemv import gemv

    g = gen(n * k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = gemv(x, w, b, block_n=8, block_k=32)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # float32 sums in another order than the reference's: a few ulps in fp32, one rounding in bf16.
    torch.testing.assert_close(out.float(), ref, **({"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}))
    with pytest.raises(ValueError, match="x must have shape|x has shape"):
        gemv(torch.randn(2, k).to(dtype), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_gemv_equals_silu_and_mul_then_linear(dtype: torch.dtype) -> None:
    """The MLP's batch-1 down projection with the activation fused in."""
    from shared.model.kernels.gemv import gemv

    g = gen(12)
    gate_up = (3 * torch.randn(1, 2 * 96, generator=g)).to(dtype)
    w = torch.randn(24, 96, generator=g).to(dtype)
    act = silu_and_mul_ref(gate_up[:, :96], gate_up[:, 96:])
    ref = torch.nn.functional.linear(act.float(), w.float())
    out = gemv(gate_up, w, gated=True, block_n=8, block_k=32)
    torch.testing.assert_close(out.float(), ref, **({"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}))
    # The activation computes and rounds as the unfused kernel path's silu_and_mul kernel.
    unfused = silu_and_mul(gate_up[:, :96], gate_up[:, 96:])
    assert torch.equal(out, gemv(unfused, w, block_n=8, block_k=32))
