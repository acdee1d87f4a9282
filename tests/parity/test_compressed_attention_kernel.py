"""DeepSeek-V4's compressed-attention kernel (shared/model/kernels/compressed_attention.py)
against the PyTorch path it replaces (compressed_batch: window_keys, the entry gather,
attend_rows), under Triton's interpreter on the CPU, small shapes
(tests/helpers/compressed_attention_cases.py: scattered blocks, a key floor, a row that
sees no entry, heads past the kernel's 16-head tile, rows wider than the head, sinks).

Tolerance, of the output's scale: 1e-5 in float32 (the online softmax sums in another
order; measured ~1e-7), 5e-3 in float16 (the reference rounds scores and probabilities to
float16, the kernel keeps them in float32; measured <= 8.6e-4). bfloat16 is not run here:
the interpreter's dot on bfloat16 operands returns garbage (~1e8; numpy has no bfloat16),
so bfloat16 is tests/gpu/test_gpu_compressed_attention.py's.
TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.model.kernels import compressed_attention as ck  # noqa: E402
from shared.model.loader import load_model  # noqa: E402
from shared.model.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from shared.model.ops import TORCH_OPS  # noqa: E402
from tests.helpers.compressed_attention_cases import (  # noqa: E402
    BLOCK, WINDOW, kernel_case, reference, relative_error, run_kernel,
)  # fmt: skip
from tests.helpers.deepseek_v4_models import save_tiny_v4  # noqa: E402
from tests.helpers.hf_models import random_prompts  # noqa: E402
from tests.helpers.numerics import rel_err  # noqa: E402
from tests.helpers.paged_driver import PagedDriver  # noqa: E402

if not isinstance(ck._compressed_attention_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize(
    "heads,head_dim,picks,floor",
    [(4, 32, 6, False), (20, 32, 6, True), (16, 64, 0, True), (3, 16, 37, False)],
    ids=["csa-like", "heads-past-a-tile+floor", "window-only+floor", "more-picks-than-a-tile"],
)
def test_kernel_equals_the_gathered_torch_path(
    heads: int, head_dim: int, picks: int, floor: bool, dtype: torch.dtype
) -> None:
    case = kernel_case(heads, head_dim, picks, floor, dtype, seed=heads + picks)
    want, got = reference(case), run_kernel(ck.compressed_attention, case, block_n=16)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert relative_error(got, want) <= TOLERANCE[dtype]


def test_what_the_kernel_reads_matters() -> None:
    """The comparison has teeth: without the floor, the sinks or the entries' mask the
    reference moves far past the tolerance."""
    case = kernel_case(4, 32, 6, True, torch.float32, seed=1)
    got = run_kernel(ck.compressed_attention, case)
    assert relative_error(got, reference(case)) <= TOLERANCE[torch.float32]
    changes = {
        "floor": {"floor": None},
        "sinks": {"sinks": torch.zeros_like(case["sinks"])},
        "visible": {"visible": torch.ones_like(case["visible"])},
    }
    for name, change in changes.items():
        assert relative_error(got, reference({**case, **change})) > 100 * TOLERANCE[torch.float32], name


def test_bad_inputs_are_refused_before_launch() -> None:
    c = kernel_case(4, 32, 6, False, torch.float32, seed=2)
    with pytest.raises(ValueError, match="all three or none"):
        ck.compressed_attention(c["query"], c["state"], c["state_tables"], c["seq"], c["pos"], None, WINDOW, BLOCK,
                                c["entries"], None, c["visible"], c["sinks"], c["scale"])  # fmt: skip
    with pytest.raises(ValueError, match="fewer than the head"):
        ck.compressed_attention(c["query"], c["state"][:, :16], c["state_tables"], c["seq"], c["pos"], None, WINDOW,
                                BLOCK, None, None, None, c["sinks"], c["scale"])  # fmt: skip


@pytest.fixture(scope="module")
def v4_triton(tmp_path_factory: pytest.TempPathFactory) -> DeepseekV4ForCausalLM:
    pytest.importorskip("transformers")
    model = load_model(save_tiny_v4("mixed", tmp_path_factory.mktemp("v4_kernel"), seed=4), kernels="triton")
    assert isinstance(model, DeepseekV4ForCausalLM)
    return model


def test_the_triton_table_chooses_the_kernel_and_a_v4_model_equals_the_gathered_path(
    v4_triton: DeepseekV4ForCausalLM,
) -> None:
    """A tiny V4 (CSA every 4 tokens with top 6, HCA every 16, a window of 16) on the Triton
    table: chunked prefill of two prompts (37 and 22 tokens: the CSA rows pick 6 of up to
    9 entries), then two decode steps; its logits with the kernel equal those with the
    gathered PyTorch path (the same model, attend_kernel None), 1e-5 relative."""
    layers = [layer.self_attn for layer in v4_triton.model.layers]
    assert all(attn.attend_kernel is ck.compressed_attention for attn in layers)
    assert TORCH_OPS.compressed_attention is None
    prompts = random_prompts([37, 22], 512, seed=6)
    steps = [{0: prompts[0][:20], 1: prompts[1]}, {0: prompts[0][20:]}, {0: [7], 1: [8]}, {0: [9], 1: [10]}]
    logits: dict[bool, list[dict[int, torch.Tensor]]] = {}
    try:
        for use_kernel in (True, False):
            for attn in layers:
                attn.attend_kernel = ck.compressed_attention if use_kernel else None
            driver = PagedDriver(v4_triton, 2, num_blocks=64, block_size=16, seed=1)
            logits[use_kernel] = [driver.step(step) for step in steps]
    finally:
        for attn in layers:
            attn.attend_kernel = ck.compressed_attention
    for k, (got, want) in enumerate(zip(logits[True], logits[False])):
        for s in want:
            assert rel_err(got[s], want[s]) < 1e-5, f"step {k}, sequence {s}"
