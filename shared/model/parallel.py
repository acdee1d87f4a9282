"""Which slice of a model this process holds, and the collectives that join the slices.

A ``ParallelContext`` is handed to a model when it is built (``build_model(...,
parallel=)``); nothing reads it from a global. ``SINGLE`` (one rank) is the default:
every model built without one is the whole model, and the layers below skip every
collective, so one process runs exactly the code it ran before tensor parallelism.

The process group is made by whoever starts the ranks (the engine's executor,
shared/engine/executor); the model only calls ``all_reduce`` and ``all_gather`` on it.
Tensor parallelism (Megatron's layout, as vLLM and SGLang run it): attention heads and
the MLP's intermediate columns are split across the ranks, the row-parallel
projections after them (o_proj, down_proj) sum their partial outputs with one
all-reduce each, the vocabulary is split for the embedding (all-reduce) and the head
(all-gather).

Expert parallelism (shared/model/expert_parallel_model.py) is the context's other
half: ``ep_rank`` / ``ep_size`` and ``ep_group``, read by the MoE layers only. An
expert-parallel model is built with its attention and dense layers as the tensor half
says (split over the same ranks, vLLM's ``--tensor-parallel-size N
--enable-expert-parallel``; or tp_size 1: whole on every rank, data-parallel
attention's), its MoE layers whole, then made expert-parallel over the
group; ``ep_group`` is a ``torch.distributed.ProcessGroup`` because the dispatch is
an ``all_to_all_single``, which a bare backend does not offer.

``Shard`` tells the loader which rows (or columns) of a checkpoint tensor a rank's
parameter holds: the loader reads the whole tensor, checks its full shape, and copies
the shard's slice.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class CollectiveGroup(Protocol):
    """What the context needs of a process group: a c10d backend object (gloo's or NCCL's,
    made from a store by shared/engine/executor/process_group.py) has these."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Any: ...

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]) -> Any: ...


@dataclass(frozen=True, slots=True)
class Shard:
    """A parameter holds ``size`` entries of a checkpoint tensor along ``dim``, from ``start``;
    the checkpoint's tensor has ``full`` entries along it."""

    dim: int
    start: int
    size: int
    full: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.size)

    def region(self) -> tuple[slice, ...]:
        """The slice as an index of the checkpoint tensor: what the loader reads of the file."""
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.size),)


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """This rank's place in its tensor-parallel group and in its expert-parallel group.
    ``group`` is None exactly when tp_size is 1, ``ep_group`` exactly when ep_size is 1
    (no collective ever runs)."""

    tp_rank: int = 0
    tp_size: int = 1
    group: CollectiveGroup | None = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in [0, {self.tp_size})")
        if (self.group is None) != (self.tp_size == 1):
            raise ValueError("a process group is given exactly when tp_size > 1")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} is not in [0, {self.ep_size})")
        if (self.ep_group is None) != (self.ep_size == 1):
            raise ValueError("an expert-parallel group is given exactly when ep_size > 1")

    @property
    def is_expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def split(self, total: int, what: str) -> int:
        """This rank's part of ``total`` (heads, columns) split evenly: a ValueError
        naming ``what`` where it does not divide."""
        if total % self.tp_size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.tp_size})")
        return total // self.tp_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place (the tensor itself when tp_size is 1)."""
        if self.group is not None:
            self.group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order, on every rank."""
        if self.group is None:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        self.group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()
"""One rank holding the whole model: the default everywhere."""
