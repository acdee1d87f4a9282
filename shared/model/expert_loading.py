"""Which expert bytes of a checkpoint an expert-parallel rank reads (issue 28).

A rank holds the experts of its slots (an EPLB placement's, redundant replicas
included) and nothing else, so reading the other experts from the files would cost N
ranks N times the host memory and read time of one. Given the experts each MoE layer
keeps on this rank, ``expert_reads`` tells the loader, for each checkpoint tensor that
lands in a layer's stacked experts:

- a fused tensor (``experts.gate_up_proj`` [E, ...], GPT-OSS's and transformers' fused
  spelling, DeepSeek-V4's when saved so): the rows of dim 0 to read, the held experts;
- a per-expert tensor (``experts.<e>.gate_proj.weight``...): skipped when expert e is
  held elsewhere.

The targets are matched to the stacked tensors by storage, not by name, so every
family's spelling (``checkpoint_names``, V4's own) is covered alike. The rows not read
stay as allocated: the model is made expert-parallel right after loading
(shared/model/expert_parallel_model.py), which keeps only the held experts' rows.
"""

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shared.model.moe import Experts, SparseMoE


@dataclass(frozen=True, slots=True)
class ExpertReads:
    rows: dict[str, tuple[int, ...]]
    """Fused checkpoint name -> the experts (indices of its dim 0) to read, ascending."""
    skipped: frozenset[str]
    """Per-expert checkpoint names of experts this rank does not hold: not read."""


def expert_reads(model: nn.Module, targets: Mapping[str, torch.Tensor], held: Sequence[Collection[int]]) -> ExpertReads:
    """``held[i]``: the experts MoE layer i (in module order, as an EPLB placement's rows)
    keeps on this rank. Experts kept packed (MXFP4) are read whole: they cannot be split."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if len(held) != len(blocks):
        raise ValueError(f"{len(blocks)} MoE blocks but held experts for {len(held)}")
    stacks: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}  # storage address -> (stacked tensor, held experts)
    for block, experts in zip(blocks, held):
        if not isinstance(block.experts, Experts) or block.experts.mxfp4:
            continue
        for whole in block.experts.stacked().values():
            stacks[whole.untyped_storage().data_ptr()] = (whole, frozenset(experts))
    rows: dict[str, tuple[int, ...]] = {}
    skipped: set[str] = set()
    for name, target in targets.items():
        stack = stacks.get(target.untyped_storage().data_ptr())
        if stack is None:
            continue
        whole, mine = stack
        offset = target.storage_offset() - whole.storage_offset()
        if target.dim() == whole.dim() and offset == 0 and target.shape[0] == whole.shape[0]:
            rows[name] = tuple(sorted(mine))  # the whole stack (GPT-OSS's a transposed view: dim 0 stays E)
        elif offset // whole.stride(0) not in mine:
            skipped.add(name)
    return ExpertReads(rows, frozenset(skipped))


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending indices as [start, stop) runs of consecutive ones: one file read each."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
