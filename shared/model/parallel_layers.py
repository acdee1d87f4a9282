"""The tensor-parallel forms of the dense layers (Megatron's split, as vLLM's
vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py have it).

A model built with one rank never constructs these: it keeps ``Linear``,
``MergedLinear``, ``MLP`` and ``nn.Embedding`` (shared/model/layers.py), so one process
runs the code it always ran. With ``tp_size`` ranks:

- ``MergedColumnParallelLinear``: each part (q, k, v or gate, up) split by output rows;
  the output stays split (each rank goes on with its heads or columns);
  ``ColumnParallelLinear`` the same for one projection (DeepSeek-V4's q_b_proj by
  heads, o_a_proj by head group);
- ``RowParallelLinear``: the input columns split, partial products summed by one
  all-reduce, the bias added once after it;
- ``VocabParallelEmbedding``: each rank looks up the ids in its slice of the vocabulary,
  zero elsewhere, and the all-reduce assembles the rows (x + 0 is exact, so the
  embedding is bitwise the single-rank one);
- ``VocabParallelHead``: each rank's slice of the logits, gathered by the model.

Each declares, by ``loaded_shards(module_name)``, which slice of which checkpoint tensor
it holds (``Shard``); ``CausalLM.checkpoint_shards`` collects them for the loader.
"""

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.layers import Linear, MergedLinear, linear, silu_and_mul
from shared.model.ops import TORCH_OPS, Ops
from shared.model.parallel import ParallelContext, Shard


def column_shard(full: int, parallel: ParallelContext, what: str) -> Shard:
    """This rank's equal share of ``full`` output rows."""
    size = parallel.split(full, what)
    return Shard(0, parallel.tp_rank * size, size, full)


def kv_head_shard(num_kv_heads: int, head_dim: int, parallel: ParallelContext) -> Shard:
    """This rank's KV heads as rows of k_proj / v_proj (``kv_heads_of_rank``)."""
    start, size = kv_heads_of_rank(num_kv_heads, parallel.tp_rank, parallel.tp_size)
    return Shard(0, start * head_dim, size * head_dim, num_kv_heads * head_dim)


def kv_heads_of_rank(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank ``tp_rank`` of ``tp_size`` holds. With fewer KV
    heads than ranks each KV head is replicated on tp_size / num_kv_heads ranks (as vLLM
    does): rank r keeps KV head r // (tp_size / num_kv_heads), the one its query heads
    read. A plain function of the three numbers, so that who moves an instance's KV (its
    region over every rank, shared/kv/memory/ranked_region.py) splits it as the model did."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size ({tp_size})"
            )
        size = num_kv_heads // tp_size
        return tp_rank * size, size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide num_key_value_heads ({num_kv_heads}) or be a multiple of it"
        )
    return tp_rank // (tp_size // num_kv_heads), 1


class MergedColumnParallelLinear(MergedLinear):
    """``MergedLinear`` holding each part's ``Shard`` of rows: ``parts`` maps each part's
    checkpoint name to its shard (whose size is the local rows)."""

    fp8_keepable = False  # kept FP8 weights are not sharded (the engine refuses keep with TP)

    def __init__(
        self, in_features: int, parts: dict[str, Shard], bias: bool, dtype: torch.dtype, device: torch.device,
        ops: Ops = TORCH_OPS,
    ) -> None:  # fmt: skip
        super().__init__(in_features, {name: shard.size for name, shard in parts.items()}, bias, dtype, device, ops)
        self.parts = dict(parts)

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        parent = module_name.rpartition(".")[0]
        names = ("weight", "bias") if self.bias is not None else ("weight",)
        return {f"{parent}.{part}.{n}": shard for part, shard in self.parts.items() for n in names}


class ColumnParallelLinear(Linear):
    """``Linear`` holding the rows ``shard`` names of one projection's output (a rank's
    heads, or head groups); the output stays split."""

    fp8_keepable = False

    def __init__(
        self, in_features: int, shard: Shard, bias: bool, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
    ) -> None:  # fmt: skip
        super().__init__(in_features, shard.size, bias, dtype, device, ops)
        self.shard = shard

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        names = ("weight", "bias") if self.bias is not None else ("weight",)
        return {f"{module_name}.{n}": self.shard for n in names}


class RowParallelLinear(Linear):
    """``Linear`` over this rank's columns of the input; the ranks' partial outputs summed."""

    fp8_keepable = False

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
        ops: Ops, parallel: ParallelContext, what: str,
    ) -> None:  # fmt: skip
        local = parallel.split(in_features, what)
        super().__init__(local, out_features, bias, dtype, device, ops)
        self.parallel = parallel
        self.in_shard = Shard(1, parallel.tp_rank * local, local, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Nothing to reduce in a zero-row step's product, but every rank still joins the
        # all-reduce: the ranks' collectives must pair up one for one.
        out = self.parallel.all_reduce(linear(x, self.weight, None, self._gemv))
        return out if self.bias is None else out + self.bias

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        return {f"{module_name}.weight": self.in_shard}


def vocab_shard(vocab_size: int, parallel: ParallelContext) -> tuple[int, Shard]:
    """(rows per rank, this rank's Shard of the vocabulary). Rows per rank is the
    vocabulary divided up rounded up; the last rank's surplus rows stay zero, so the
    gathered logits are the vocabulary's followed by padding, cut off by the model."""
    per_rank = -(-vocab_size // parallel.tp_size)
    start = min(parallel.tp_rank * per_rank, vocab_size)
    return per_rank, Shard(0, start, min(per_rank, vocab_size - start), vocab_size)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` over this rank's slice of the vocabulary (``weight`` named as there)."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext) -> None:  # fmt: skip
        super().__init__()
        per_rank, self.shard = vocab_shard(vocab_size, parallel)
        # Zeros, not empty: the padding rows take part in the tied head's product.
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden, dtype=dtype, device=device), requires_grad=False)
        self.parallel = parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(rows.masked_fill_(outside[:, None], 0))

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        return {f"{module_name}.weight": self.shard}


def vocab_embedding(
    vocab_size: int, hidden: int, dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext
) -> nn.Module:
    """The token embedding: vocab-parallel over the ranks (VocabParallelEmbedding), else
    whole. ``_weight`` skips nn.Embedding's random init, which costs seconds on a large
    vocabulary (the checkpoint's values come next)."""
    if parallel.is_parallel:
        return VocabParallelEmbedding(vocab_size, hidden, dtype, device, parallel)
    weight = torch.empty(vocab_size, hidden, dtype=dtype, device=device)
    return nn.Embedding(vocab_size, hidden, _weight=weight, _freeze=True)


class VocabParallelHead(Linear):
    """The LM head's rows of this rank's vocabulary slice (the model gathers the logits)."""

    fp8_keepable = False

    def __init__(self, hidden: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext) -> None:  # fmt: skip
        per_rank, self.shard = vocab_shard(vocab_size, parallel)
        super().__init__(hidden, per_rank, False, dtype, device)
        self.weight.data.zero_()  # the padding rows' logits: cut off, but never NaN

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        return {f"{module_name}.weight": self.shard}


class ParallelMLP(nn.Module):
    """``MLP`` (shared/model/layers.py) over this rank's intermediate columns: gate and up
    column-parallel, down row-parallel. No fused batch-1 GEMV here: it would skip the
    all-reduce."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, device: torch.device, ops: Ops,
        parallel: ParallelContext,
    ) -> None:  # fmt: skip
        super().__init__()
        part = column_shard(intermediate, parallel, "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {"gate_proj": part, "up_proj": part}, bias, dtype,
                                                       device, ops)  # fmt: skip
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype, device, ops, parallel, "intermediate_size")
        self._act = ops.activation or silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self._act(gate, up))
