"""V4's decode step can be captured in a CUDA graph: checked on the CPU, where no graph
can be, by what capture forbids. A tiny V4 on the Triton table (fused MoE, fused mHC,
under Triton's interpreter) and the batched attention runs decode steps with the
metadata DecodeGraphs hands it (host lists at the capture bound, lengths in tensors,
padding rows, a scratch slot), and

- nothing in the step reads the device from the host (item, nonzero, bincount,
  repeat_interleave with tensor counts, tolist...) nor builds a tensor from host data
  (on CUDA an upload, which a capture refuses);
- the model says it supports CUDA graphs on the Triton table, and not on the torch one
  (whose MoE reads run lengths) nor with the per-sequence reference attention;
- its logits equal the eager step's (1e-5 relative).

The GPU twin (a real capture and replay against eager) is tests/gpu/test_gpu_v4_graphs.py.
TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from shared.model.loader import load_model  # noqa: E402
from shared.model.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from tests.helpers.deepseek_v4_models import save_tiny_v4  # noqa: E402
from tests.helpers.hf_models import random_prompts  # noqa: E402
from tests.helpers.numerics import rel_err  # noqa: E402
from tests.helpers.paged_driver import GraphShapedPair  # noqa: E402

pytest.importorskip("transformers")

HOST_READS = ("_local_scalar_dense", "nonzero", "bincount", "unique", "masked_select", "repeat_interleave",
              "is_nonzero", "lift_fresh")  # fmt: skip
"""aten ops that read a device tensor on the host (or, lift_fresh, make one from host data)."""


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__
        if name.startswith(HOST_READS):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DeepseekV4ForCausalLM]:
    path: Path = save_tiny_v4("mixed", tmp_path_factory.mktemp("v4_capturable"), seed=4)
    loaded = {k: load_model(path, kernels=k) for k in ("torch", "triton")}
    assert all(isinstance(m, DeepseekV4ForCausalLM) for m in loaded.values())
    return loaded  # type: ignore[return-value]


def test_only_the_triton_table_with_batched_attention_supports_graphs(models: dict[str, DeepseekV4ForCausalLM]) -> None:
    assert models["triton"].supports_cuda_graphs
    assert not models["torch"].supports_cuda_graphs
    attn = models["triton"].model.layers[1].self_attn
    attn.batched = False
    try:
        assert not models["triton"].supports_cuda_graphs
    finally:
        attn.batched = True


def test_a_graph_shaped_decode_step_reads_nothing_from_the_device(models: dict[str, DeepseekV4ForCausalLM]) -> None:
    model = models["triton"]
    # Prompts ending just before a CSA (4) and an HCA (16) window closes: the decode steps emit entries.
    prompts = random_prompts([7, 14, 15], 512, seed=5)
    pair = GraphShapedPair(model, prompts, num_blocks=64, block_size=16, seed=2, bound=64, pad=2)
    modes: list[HostReads] = []

    def host_reads() -> HostReads:
        modes.append(HostReads())
        return modes[-1]

    for k in range(2):
        step = {s: [50 + k + s] for s in range(3)}
        eager, graphed = pair.step(step, within=host_reads)
        for s in step:
            assert rel_err(graphed[s], eager[s]) < 1e-5, f"decode {k}, sequence {s}"
    reads = [mode.seen for mode in modes]
    assert reads == [[], []], f"host reads in a graph-shaped step: {reads}"
    # The detector sees a read where there is one: the reference attention's nonzero.
    for layer in model.model.layers:
        layer.self_attn.batched = False
    try:
        with HostReads() as mode:
            pair.eager.step({s: [60 + s] for s in range(3)})
    finally:
        for layer in model.model.layers:
            layer.self_attn.batched = True
    assert any(name.startswith("nonzero") for name in mode.seen), mode.seen
