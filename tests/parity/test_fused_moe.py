"""The Triton fused MoE (shared/model/kernels/fused_moe.py) on the CPU under Triton's
interpreter: the alignment by expert, the kernels against the PyTorch path (SiLU,
clamped SiLU, GPT-OSS with biases) in float32 and float16, the tiny Qwen3-MoE and
GPT-OSS models with kernels="triton" against "torch" (logits, expert counts, the
engine's greedy tokens), and that the fused path reads nothing back to the host, which
is what lets MoE models run in CUDA graphs (graphs themselves need a GPU: tests/gpu).

TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.engine.llm import LLM  # noqa: E402
from shared.engine.sampling_params import SamplingParams  # noqa: E402
from shared.model.forward_batch import AttentionMetadata  # noqa: E402
from shared.model.kernels import fused_moe as fm  # noqa: E402
from shared.model.kernels.fused_moe import align_by_expert, fused_moe, fused_moe_ref  # noqa: E402
from shared.model.loader import load_model  # noqa: E402
from shared.model.interface import CausalLM  # noqa: E402
from shared.model.moe import SparseMoE, counted_tokens  # noqa: E402
from shared.model.moe_config import MoEConfig  # noqa: E402
from tests.helpers.paged_driver import PagedDriver  # noqa: E402
from tests.helpers.numerics import rel_err  # noqa: E402
from tests.helpers.hf_models import save_tiny_hf_model  # noqa: E402
from shared.model.ops import triton_ops  # noqa: E402

if not isinstance(fm._gate_up_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")

# Products of ~50 terms summed in another order: float32 to ~1e-6, float16 to its ulp.
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
VARIANTS = {
    "silu": dict(activation="silu", swiglu_limit=None, bias=False),
    "silu_clamped": dict(activation="silu", swiglu_limit=0.5, bias=False),
    "gpt_oss_biased": dict(activation="gpt_oss", swiglu_limit=0.5, bias=True),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def expert_ids(num_tokens: int, num_experts: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """Distinct experts per token; expert 0 gets nobody and expert 1 everybody, so empty
    runs and runs longer than a block both occur."""
    rest = [torch.randperm(num_experts - 2, generator=g)[: top_k - 1].add(2).tolist() for _ in range(num_tokens)]
    return torch.tensor([[1, *r] for r in rest])


# -- alignment -------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 2, 8, 16), (37, 3, 6, 16), (20, 2, 4, 8)])
def test_align_by_expert_blocks_hold_one_expert_each(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    g = gen(num_tokens)
    ids = expert_ids(num_tokens, num_experts, top_k, g)
    blocks = align_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = ids.reshape(-1)
    assert torch.equal(blocks.counts, torch.bincount(flat, minlength=num_experts))
    pairs = blocks.sorted_pairs.tolist()
    # Every pair exactly once; the rest padding.
    assert sorted(p for p in pairs if p < num_pairs) == list(range(num_pairs))
    assert all(p == num_pairs for p in pairs if p >= num_pairs)
    # Each used block holds pairs of its expert only, in token order; unused blocks are -1 and empty.
    used: list[int] = []
    for b, expert in enumerate(blocks.block_expert.tolist()):
        rows = [p for p in pairs[b * block_m : (b + 1) * block_m] if p < num_pairs]
        if expert < 0:
            assert rows == []
            continue
        used.append(expert)
        assert rows and all(int(flat[p]) == expert for p in rows)
        assert rows == sorted(rows)
    # Experts in order, each with as many blocks as its count needs.
    expected = [e for e, n in enumerate(blocks.counts.tolist()) for _ in range(-(-n // block_m))]
    assert used == expected
    # The bound holds and is tight to a block when every expert is used.
    assert len(pairs) % block_m == 0 and len(pairs) >= sum(-(-n // block_m) * block_m for n in blocks.counts.tolist())


# -- the kernels against the reference ------------------------------------------------


def moe_inputs(dtype: torch.dtype, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
               bias: bool, seed: int) -> dict[str, torch.Tensor | None]:  # fmt: skip
    g = gen(seed)
    return dict(
        x=torch.randn(num_tokens, hidden, generator=g).to(dtype),
        gate_up=(torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype),
        down=(torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype),
        ids=expert_ids(num_tokens, num_experts, top_k, g),
        weights=torch.rand(num_tokens, top_k, generator=g).to(dtype),
        gate_up_bias=torch.randn(num_experts, 2 * inter, generator=g).to(dtype) if bias else None,
        down_bias=torch.randn(num_experts, hidden, generator=g).to(dtype) if bias else None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_tokens,hidden,inter", [(1, 32, 16), (21, 48, 40)])
def test_fused_moe_equals_the_pytorch_path(dtype: torch.dtype, variant: str, num_tokens: int, hidden: int, inter: int) -> None:
    """Small tiles (16), so dimensions not a multiple of a tile, several blocks per expert
    and several tiles along N and K all occur."""
    v = VARIANTS[variant]
    inputs = moe_inputs(dtype, num_tokens, hidden, inter, num_experts=6, top_k=2, bias=v["bias"], seed=num_tokens)
    kwargs = dict(activation=v["activation"], swiglu_limit=v["swiglu_limit"])
    expected = fused_moe_ref(**inputs, **kwargs)  # type: ignore[arg-type]
    out = fused_moe(**inputs, **kwargs, block_m=16, block_n=16, block_k=16)  # type: ignore[arg-type]
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    if v["swiglu_limit"] is not None:  # the clamp bites on these inputs
        unclamped = fused_moe(**inputs, activation=v["activation"], swiglu_limit=1e9, block_m=16, block_n=16, block_k=16)  # type: ignore[arg-type]
        assert (unclamped.float() - out.float()).abs().max() > 1e-2


def test_fused_moe_default_tiles_and_prealigned_blocks() -> None:
    inputs = moe_inputs(torch.float32, 40, 64, 32, num_experts=4, top_k=2, bias=False, seed=9)
    expected = fused_moe_ref(**inputs)  # type: ignore[arg-type]
    torch.testing.assert_close(fused_moe(**inputs), expected, **TOL[torch.float32])  # type: ignore[arg-type]
    ids = inputs["ids"]
    assert ids is not None
    blocks = align_by_expert(ids, 4, 32)
    torch.testing.assert_close(fused_moe(**inputs, blocks=blocks), expected, **TOL[torch.float32])  # type: ignore[arg-type]


def test_fused_moe_of_no_tokens_is_empty() -> None:
    inputs = moe_inputs(torch.float32, 0, 32, 16, num_experts=4, top_k=2, bias=False, seed=1)
    inputs["ids"] = torch.zeros(0, 2, dtype=torch.int64)
    assert fused_moe(**inputs).shape == (0, 32)  # type: ignore[arg-type]


def test_wrapper_raises_value_errors_naming_the_argument() -> None:
    inputs = moe_inputs(torch.float32, 3, 32, 16, num_experts=4, top_k=2, bias=False, seed=2)
    cases = [
        (dict(down=torch.zeros(4, 32, 8)), "down"),
        (dict(ids=torch.zeros(3, 2)), "ids"),
        (dict(weights=torch.zeros(3, 3)), "weights"),
        (dict(gate_up=torch.zeros(4, 33, 32)), "gate_up"),
        (dict(gate_up_bias=torch.zeros(4, 32)), "down_bias"),
        (dict(activation="gelu"), "activation"),
        (dict(activation="gpt_oss"), "swiglu_limit"),
        (dict(block_n=24), "block_n"),
        (dict(block_m=8), "block_m"),
    ]
    for change, name in cases:
        with pytest.raises(ValueError, match=name):
            fused_moe(**{**inputs, **change})  # type: ignore[arg-type]


# -- in the model ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=1)


def test_tiny_moe_model_triton_equals_torch(checkpoint: Path) -> None:
    """Varlen prefill, then a chunk on a cached prefix beside decodes: the same logits and
    the same tokens per expert with either kernels setting; only Triton can be captured."""
    models = {k: load_model(checkpoint, kernels=k) for k in ("torch", "triton")}
    assert models["triton"].supports_cuda_graphs and not models["torch"].supports_cuda_graphs
    drivers = {k: PagedDriver(m, num_seqs=3, block_size=4, seed=1) for k, m in models.items()}
    g = gen(4)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 11, 14)]
    for step in ({0: prompts[0], 1: prompts[1][:6]}, {1: prompts[1][6:], 0: [7], 2: prompts[2]}, {0: [3], 1: [9], 2: [4]}):
        outs = {k: d.step(step) for k, d in drivers.items()}
        for s in step:
            assert rel_err(outs["triton"][s], outs["torch"][s]) < 1e-5, f"sequence {s}"
        torch_counts, triton_counts = models["torch"].expert_counts, models["triton"].expert_counts
        assert torch_counts is not None and triton_counts is not None
        assert torch.equal(triton_counts, torch_counts)


def test_engine_with_fused_moe_generates_as_torch_and_counts_alike(checkpoint: Path) -> None:
    """Chunked prefill and continuous batching with overlapped steps (the GPU's schedule)."""
    prompts = [[5, 9, 31, 7, 2, 8, 1], [44, 3, 17, 9, 90, 12, 4, 6, 71, 10, 3]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs, counts = {}, {}
    for kernels in ("torch", "triton"):
        llm = LLM(str(checkpoint), kernels=kernels, block_size=4, prefill_chunk_size=8, async_scheduling=True)
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
        counts[kernels] = llm.engine.load().tokens_per_expert
    assert outs["triton"] == outs["torch"]
    assert counts["triton"] == counts["torch"] and counts["torch"] is not None


# -- no host reads ---------------------------------------------------------------------

# What reads a device tensor on the host: .item()/int()/bool() (_local_scalar_dense),
# ops whose output size is the data's (nonzero, bincount, unique, masked_select,
# repeat_interleave without output_size). .tolist() reads without dispatching: patched.
HOST_READS = ("_local_scalar_dense", "nonzero", "bincount", "unique", "masked_select", "repeat_interleave", "is_nonzero")


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if any(name.startswith(r) for r in HOST_READS):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads_recorded() -> Iterator[HostReads]:
    mode = HostReads()
    original = torch.Tensor.tolist

    def tolist(t: torch.Tensor):  # type: ignore[no-untyped-def]
        mode.seen.append("tolist")
        return original(t)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with mode:
            yield mode
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def decode_batch(model: CausalLM, num_seqs: int, padding: int) -> tuple[torch.Tensor, torch.Tensor, list, list[AttentionMetadata]]:
    """A decode step as the CUDA graph runs it: device lengths, ``padding`` rows of seq_len 0
    whose KV goes to a scratch slot."""
    n = num_seqs + padding
    caches = model.allocate_kv_cache(16, 4, torch.float32, "cpu")
    seq_lens = [3 + s for s in range(num_seqs)] + [0] * padding
    tables = torch.tensor([[1 + 2 * s, 2 + 2 * s] for s in range(n)])
    slots = torch.tensor([int(tables[s, (max(L, 1) - 1) // 4]) * 4 + (max(L, 1) - 1) % 4 for s, L in enumerate(seq_lens)])
    slots[num_seqs:] = 15 * 4  # the scratch slot
    metas = [
        AttentionMetadata(
            slot_mapping=slots, block_tables=tables, query_start_loc=list(range(n + 1)), seq_lens=[8] * n, block_size=4,
            query_start_loc_tensor=torch.arange(n + 1, dtype=torch.int32),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        )
        for _ in model.kv_layout.groups
    ]  # fmt: skip
    input_ids = torch.tensor([11 + 7 * s for s in range(n)])
    positions = torch.tensor([max(L, 1) - 1 for L in seq_lens])
    return input_ids, positions, caches, metas


def test_fused_path_reads_nothing_back_to_the_host(checkpoint: Path) -> None:
    """A decode step of the whole model with the fused experts, its lengths on the device
    as a CUDA graph runs it, makes no host read (the kernels launch on grids known from
    the shapes); the PyTorch path, which slices runs on the host, is caught doing one."""
    for kernels, reads in (("triton", False), ("torch", True)):
        model = load_model(checkpoint, kernels=kernels)
        batch = decode_batch(model, num_seqs=3, padding=0)
        with host_reads_recorded() as recorded:
            model(*batch)
        assert bool(recorded.seen) == reads, (kernels, recorded.seen)


def test_padding_rows_of_a_graph_batch_are_not_counted(checkpoint: Path) -> None:
    """The same three sequences with five padding rows (a bucket of 8) count what the three
    alone count: the routers' choices of the real rows."""
    model = load_model(checkpoint, kernels="triton")
    assert model.expert_counts is not None
    model(*decode_batch(model, num_seqs=3, padding=0))
    alone = model.expert_counts.clone()
    input_ids, positions, caches, metas = decode_batch(model, num_seqs=3, padding=5)
    counted = counted_tokens(metas[0], input_ids.shape[0])
    assert counted is not None and counted.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    model(input_ids, positions, caches, metas)
    assert torch.equal(model.expert_counts, alone)
    assert int(alone.sum()) == 3 * model.config.moe.top_k * alone.shape[0]  # type: ignore[union-attr]


def test_counted_tokens_is_none_for_eager_batches() -> None:
    meta = AttentionMetadata(torch.zeros(5, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), [0, 3, 5], [3, 2], 4,
                             seq_lens_tensor=torch.tensor([3, 2], dtype=torch.int32))  # fmt: skip
    assert counted_tokens(meta, 5) is None
    block = SparseMoE(16, MoEConfig(4, 2, 8), "moe", 10, torch.float32, torch.device("cpu"), ops=triton_ops())
    assert block.host_sync_free
    assert not SparseMoE(16, MoEConfig(4, 2, 8), "moe", 10, torch.float32, torch.device("cpu")).host_sync_free
