"""Attention sinks (GPT-OSS): the PyTorch reference against a direct per-sequence
softmax with the sink column, then both Triton paged kernels against the reference
under Triton's interpreter, then a tiny GPT-OSS model with kernels="triton" against
kernels="torch". As in tests/parity/test_kernels.py, TRITON_INTERPRET is set before any
kernel module is imported."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from shared.model.config import ModelConfig  # noqa: E402
from shared.model.kernels.paged_decode import paged_decode_attention  # noqa: E402
from shared.model.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from shared.model.kernels.reference import paged_attention_ref  # noqa: E402
from shared.model.loader import load_weights  # noqa: E402
from shared.model.models import build_model  # noqa: E402
from tests.helpers.paged_driver import PagedDriver  # noqa: E402
from tests.helpers.numerics import rel_err  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def paged(g: torch.Generator, seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int):
    """A random cache with each sequence's blocks scattered; tables padded with block 0."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(-(-n // block_size) for n in seq_lens) + 1, dtype=torch.int64)
    for s, n in enumerate(seq_lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = free.pop()
    return kv_cache, tables


def direct_attention(query, kv_cache, tables, query_lens, seq_lens, window, scale, sinks):
    """One sequence, one head, one query at a time: softmax over [scores of the keys it
    may see, the head's sink], the sink's share dropped."""
    heads, head_dim = query.shape[1:]
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty_like(query)
    row = 0
    for s, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        slots = [int(tables[s, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
        keys = kv_cache[0].reshape(-1, kv_heads, head_dim)[slots]
        values = kv_cache[1].reshape(-1, kv_heads, head_dim)[slots]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                logits = keys[lo : pos + 1, kvh] @ query[row, h] * scale
                probs = torch.softmax(torch.cat([logits, sinks[h : h + 1]]), dim=0)[:-1]
                out[row, h] = probs @ values[lo : pos + 1, kvh]
            row += 1
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_reference_with_sinks_is_the_direct_softmax(window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [3, 1, 6], [3, 12, 17]
    kv_cache, tables = paged(g, seq_lens, 4, 2, 16)
    query = torch.randn(sum(query_lens), 4, 16, generator=g)
    sinks = 2 * torch.randn(4, generator=g)
    starts = [0, 3, 4, 10]
    ref = paged_attention_ref(query, kv_cache, starts, seq_lens, tables, window, 0.25, sinks=sinks)
    direct = direct_attention(query, kv_cache, tables, query_lens, seq_lens, window, 0.25, sinks)
    torch.testing.assert_close(ref, direct, **TOL)
    # The sinks take weight: without them the output differs.
    plain = paged_attention_ref(query, kv_cache, starts, seq_lens, tables, window, 0.25)
    assert (plain - ref).abs().max() > 1e-2


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_kernel_with_sinks(num_splits: int, window: int | None) -> None:
    g = torch.Generator().manual_seed(1)
    seq_lens = [5, 33, 70, 1]
    kv_cache, tables = paged(g, seq_lens, 8, 2, 32)
    query = torch.randn(len(seq_lens), 8, 32, generator=g)
    sinks = 2 * torch.randn(8, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention(query, kv_cache, lens, tables, 0.2, window, num_splits, sinks=sinks, block_n=16)
    ref = paged_attention_ref(query, kv_cache, list(range(len(seq_lens) + 1)), seq_lens, tables, window, 0.2, sinks=sinks)
    torch.testing.assert_close(out, ref, **TOL)


def test_decode_of_an_empty_sequence_with_sinks_is_zero() -> None:
    """A padded batch entry (length 0) has only the sink, which has no value: zeros."""
    g = torch.Generator().manual_seed(2)
    kv_cache, tables = paged(g, [9, 1], 4, 2, 16)
    query = torch.randn(2, 4, 16, generator=g)
    for splits in (1, 3):
        out = paged_decode_attention(
            query, kv_cache, torch.tensor([9, 0], dtype=torch.int32), tables, 0.25, None, splits,
            sinks=torch.randn(4, generator=g),
        )  # fmt: skip
        assert torch.equal(out[1], torch.zeros_like(out[1])) and not out.isnan().any()


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_kernel_with_sinks(window: int | None) -> None:
    """Fresh prompts, chunks on cached prefixes and a decode row in one launch."""
    g = torch.Generator().manual_seed(3)
    cached_and_new = [(0, 7), (5, 3), (13, 1), (20, 9)]
    seq_lens = [c + n for c, n in cached_and_new]
    query_lens = [n for _, n in cached_and_new]
    kv_cache, tables = paged(g, seq_lens, 4, 2, 16)
    query = torch.randn(sum(query_lens), 4, 16, generator=g)
    sinks = 2 * torch.randn(4, generator=g)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    out = paged_prefill_attention(
        query, kv_cache, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), tables,
        max(query_lens), 0.25, window, sinks=sinks, block_m=16, block_n=16,
    )  # fmt: skip
    ref = paged_attention_ref(query, kv_cache, starts, seq_lens, tables, window, 0.25, sinks=sinks)
    torch.testing.assert_close(out, ref, **TOL)


def test_sinks_shape_is_checked() -> None:
    g = torch.Generator().manual_seed(4)
    kv_cache, tables = paged(g, [4], 4, 2, 16)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(
            torch.randn(1, 4, 16), kv_cache, torch.tensor([4], dtype=torch.int32), tables, 0.25, sinks=torch.zeros(3)
        )


def test_tiny_gpt_oss_triton_equals_torch() -> None:
    """Sinks, sliding and full layers and experts through the model with either kernels setting."""
    config = ModelConfig.from_dict(
        dict(architectures=["GptOssForCausalLM"], hidden_size=64, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
             rms_norm_eps=1e-5, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))
    )  # fmt: skip
    models = {k: build_model(config, kernels=k) for k in ("torch", "triton")}
    g = torch.Generator().manual_seed(5)
    weights = {
        name: (1 + 0.1 * torch.randn(t.shape, generator=g)) if "norm" in name else torch.randn(t.shape, generator=g)
        * (1.0 if name.endswith("sinks") else 0.05)
        for name, t in models["torch"].checkpoint_tensors().items()
    }  # fmt: skip
    for model in models.values():
        load_weights(model, weights)
    drivers = {k: PagedDriver(m, num_seqs=2, block_size=4, seed=1) for k, m in models.items()}
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 13)]
    for step in ({0: prompts[0], 1: prompts[1][:6]}, {1: prompts[1][6:], 0: [7]}, {0: [3], 1: [4]}):
        outs = {k: d.step(step) for k, d in drivers.items()}
        for s in step:
            assert rel_err(outs["triton"][s], outs["torch"][s]) < 1e-5, f"sequence {s}"
