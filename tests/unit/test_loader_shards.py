"""Each rank reads only what it holds (issue 28): a tensor-parallel rank its slice of
each split tensor, an expert-parallel rank the experts of its slots. Counted on real
safetensors files: the loader's reader is wrapped so that every read it makes from the
memory-mapped files records its bytes; the loaded values are checked against a whole
single-process load."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model.checkpoint_files import CheckpointReader
from shared.model.loader import load_model
from shared.model.moe import Experts
from shared.model.parallel import ParallelContext
from tests.helpers.hf_models import save_tiny_hf_model

pytest.importorskip("transformers")


class _CountingSlice:
    """A safetensors slice that records the bytes each read of it returns."""

    def __init__(self, inner: Any, name: str, log: dict[str, int]) -> None:
        self._inner, self._name, self._log = inner, name, log

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self._inner[index]
        self._log[self._name] = self._log.get(self._name, 0) + out.numel() * out.element_size()
        return out

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Stored tensor name -> bytes read from the files, for every load inside the test."""
    log: dict[str, int] = {}
    original = CheckpointReader._slice

    def counting(self: CheckpointReader, name: str, file: str) -> Any:
        return _CountingSlice(original(self, name, file), name, log)

    monkeypatch.setattr(CheckpointReader, "_slice", counting)
    yield log


class _NoCollectives:
    """A tensor-parallel group for loading only: loading runs no collective."""


def _per_expert(folder: Path) -> Path:
    """The checkpoint rewritten with one tensor per expert (``experts.<e>.gate_proj.weight``...),
    as Qwen3-MoE's own checkpoints store them, whatever transformers saved."""
    weights = load_file(str(folder / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, i = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :i].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, i:].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _experts(model: torch.nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def _expert_bytes(log: dict[str, int]) -> int:
    return sum(n for name, n in log.items() if ".experts." in name)


# Two ranks over 8 experts, with a redundant replica on each (an EPLB placement's rows):
# rank 0 holds 5 experts, rank 1 holds 5, of 8.
HELD = ([0, 1, 2, 3, 5], [4, 5, 6, 7, 0])


# GPT-OSS checkpoints store fused experts only.
@pytest.mark.parametrize(("arch", "layout"), [("qwen3_moe", "fused"), ("qwen3_moe", "per_expert"), ("gpt_oss", "fused")])
def test_an_expert_parallel_rank_reads_only_the_experts_of_its_slots(
    tmp_path: Path, bytes_read: dict[str, int], arch: str, layout: str
) -> None:
    folder = save_tiny_hf_model(arch, tmp_path / arch)
    if layout == "per_expert":
        _per_expert(folder)
    whole = load_model(folder)
    full = _expert_bytes(bytes_read)
    assert full > 0
    for held in HELD:
        bytes_read.clear()
        rank = load_model(folder, held_experts=lambda model, held=held: [held] * len(_experts(model)))
        # 5 of 8 experts: 5/8 of the expert bytes, nothing more (the rest: attention, norms, routers).
        assert _expert_bytes(bytes_read) == full * len(held) // 8
        index = torch.tensor(held)
        for mine, ref in zip(_experts(rank), _experts(whole)):
            for name, tensor in ref.stacked().items():
                assert torch.equal(mine.stacked()[name].index_select(0, index), tensor.index_select(0, index)), name
        print(f"{arch} {layout}: rank holding {held} read {_expert_bytes(bytes_read)} of {full} expert bytes")


def test_a_tensor_parallel_rank_reads_only_its_slice_of_each_split_tensor(
    tmp_path: Path, bytes_read: dict[str, int]
) -> None:
    folder = save_tiny_hf_model("llama", tmp_path / "llama")
    whole = load_model(folder)
    full = dict(bytes_read)
    total = sum(full.values())
    for r in range(2):
        bytes_read.clear()
        parallel = ParallelContext(tp_rank=r, tp_size=2, group=_NoCollectives())  # type: ignore[arg-type]
        rank = load_model(folder, parallel=parallel)
        shards = rank.checkpoint_shards()
        assert shards
        for name, n in full.items():
            expected = n // 2 if name in shards else n  # every split tensor here splits evenly
            assert bytes_read[name] == expected, name
        ref, mine = whole.checkpoint_tensors(), rank.checkpoint_tensors()
        for name, shard in shards.items():
            assert torch.equal(mine[name].narrow(shard.dim, 0, shard.size), shard.take(ref[name])), name
        print(f"tensor-parallel rank {r}: read {sum(bytes_read.values())} of {total} bytes")


def test_a_quantised_stack_is_cut_on_dim_0_before_it_is_read(tmp_path: Path, bytes_read: dict[str, int]) -> None:
    """FP8 block-scaled experts [E, rows, cols]: dim-0 rows read from data and scales alike,
    the same values as the whole tensor's rows; a cut across the scale tiles reads it whole."""
    from shared.model.checkpoint_files import QuantScheme, TensorSource
    from shared.model.quantized import FP8_DTYPE

    data = torch.randn(4, 8, 8).to(FP8_DTYPE)
    scale = torch.rand(4, 2, 2) + 0.5
    save_file({"w.weight": data, "w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    source = TensorSource("w.weight", "model.safetensors", "w.weight_scale_inv", "model.safetensors")
    with CheckpointReader(tmp_path, QuantScheme("fp8", (4, 4), ())) as reader:
        whole = reader.read(source)
        bytes_read.clear()
        assert torch.equal(reader.read(source, (slice(1, 3),)), whole[1:3])
        assert bytes_read == {"w.weight": 2 * 64, "w.weight_scale_inv": 2 * 4 * 4}
        bytes_read.clear()
        assert torch.equal(reader.read(source, (slice(None), slice(2, 6))), whole[:, 2:6])
        assert bytes_read == {"w.weight": 4 * 64, "w.weight_scale_inv": 4 * 4 * 4}
