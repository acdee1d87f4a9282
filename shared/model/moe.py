"""Mixture-of-experts layers shared by the MoE families: the router, the experts
stored stacked ``[num_experts, ...]``, shared experts, and the block that joins them
under the checkpoint's names. ``MoEConfig`` (shared/model/moe_config.py) says which
variant each family uses.

The experts run one of two ways, chosen when the model is built (its ops table, shared/model/ops.py):

- the PyTorch path (``experts_reference``, the CPU path and the reference) sorts the
  (token, choice) pairs by expert and runs one matmul per projection per active
  expert on its contiguous run of rows. It needs the run lengths on the host, so it
  syncs once per layer: fine on the CPU, not graph capturable.
- the fused path (``kernels/fused_moe.py``, on CUDA or under Triton's interpreter):
  the pairs aligned by expert on the device and two grouped GEMMs, with no host
  read at all, so a model whose sparse layers all take it can be captured in CUDA
  graphs (``SparseMoE.host_sync_free``).

Each forward also counts tokens per expert on the device into a row of the model's
``expert_counts`` (no sync), for balancing; rows that are only a CUDA graph's
padding are not counted (``counted_tokens``).
"""

import dataclasses
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.forward_batch import AttentionMetadata
from shared.model.ops import TORCH_OPS, Kernel, Ops
from shared.model.layers import MergedLinear, Linear, linear
from shared.model.moe_config import MlpLayerType, MoEConfig
from shared.model.parallel import SINGLE, ParallelContext
from shared.model.parallel_layers import MergedColumnParallelLinear, RowParallelLinear, column_shard
from shared.model.profiling import profiled
from shared.model.quantized import FP4_GROUP, dequantize_fp4_groups


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def route(
    logits: torch.Tensor,
    moe: MoEConfig,
    selection_bias: torch.Tensor | None = None,
    hashed_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64).

    ``selection_bias`` [E] shifts the scores for choosing experts only; ``hashed_ids``
    [T, k] (hash routing) are the experts, the scores only weigh them."""
    k = moe.top_k
    if moe.scoring == "softmax_topk":
        if hashed_ids is not None or selection_bias is not None:
            raise ValueError("softmax_topk scoring chooses by logits: no hash routing or selection bias")
        values, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=values.dtype)
    else:
        if moe.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        elif moe.scoring == "sigmoid":
            scores = torch.sigmoid(logits)
        else:  # sqrtsoftplus
            scores = torch.sqrt(F.softplus(logits))
        if hashed_ids is not None:
            ids = hashed_ids.long()
        elif selection_bias is not None:
            ids = torch.topk(scores + selection_bias, k, dim=-1).indices
        else:
            ids = torch.topk(scores, k, dim=-1).indices
        weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + moe.renorm_eps)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights.to(logits.dtype), ids


class Router(nn.Module):
    """``weight`` [E, hidden] (and ``bias`` [E], ``e_score_correction_bias`` [E],
    ``tid2eid`` [vocab, k] where the variant has them, under those checkpoint names)."""

    def __init__(
        self, hidden: int, moe: MoEConfig, vocab_size: int, hashed: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.moe = moe
        self.weight = _parameter((moe.num_experts, hidden), dtype, device)
        self.bias = _parameter((moe.num_experts,), dtype, device) if moe.router_bias else None
        # DeepSeek keeps the selection bias in float32 whatever the model dtype.
        self.e_score_correction_bias = (
            _parameter((moe.num_experts,), torch.float32, device) if moe.selection_bias else None
        )
        self.tid2eid = (
            nn.Parameter(torch.zeros(vocab_size, moe.top_k, dtype=torch.int64, device=device), requires_grad=False)
            if hashed
            else None
        )
        # F.linear; batch-invariant mode installs its row kernel here (batch_invariant.make_moe_invariant),
        # since a token's logits, and so its experts, must not depend on the batch.
        self._gemv: Kernel | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, self.bias, self._gemv)
        hashed_ids = None
        if self.tid2eid is not None:
            if input_ids is None:
                raise ValueError("a hash-routed MoE layer needs the input ids")
            hashed_ids = self.tid2eid[input_ids]
        return route(logits, self.moe, self.e_score_correction_bias, hashed_ids)


def silu_gate(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """[.., 2I] with gate then up halves -> silu(gate) * up, both clamped by ``limit`` first."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def gpt_oss_gate(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2I] with gate and up interleaved (even, odd columns) -> (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(gate_up: torch.Tensor, activation: str, limit: float | None, alpha: float) -> torch.Tensor:
    """[.., 2I] -> [.., I]: SiLU experts' gate then up halves, or GPT-OSS's interleaved pair."""
    if activation == "gpt_oss":
        if limit is None:
            raise ValueError("GPT-OSS experts need swiglu_limit")
        return gpt_oss_gate(gate_up, alpha, limit)
    return silu_gate(gate_up, limit)


def experts_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str,
    limit: float | None,
    alpha: float,
    matmul: Kernel = F.linear,
) -> torch.Tensor:
    """The experts' PyTorch path: x [T, hidden], ids and weights [T, k], stacked weights
    gate_up [E, 2I, hidden] and down [E, hidden, I] (biases [E, 2I], [E, hidden] or None)
    -> sum over the k choices of weight * expert(x), [T, hidden]. ``matmul``: F.linear's
    signature (batch-invariant mode passes its row kernel)."""
    num_tokens, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.sort(flat_ids, stable=True).indices  # (token, choice) pairs grouped by expert
    token_of_row = order // k
    rows = x[token_of_row]
    out_rows = torch.empty_like(rows)
    # The host needs the run lengths to slice: the one sync of this path.
    run_lengths = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, n in enumerate(run_lengths):
        if n == 0:
            continue
        end = start + n
        expert_gate_up_bias = None if gate_up_bias is None else gate_up_bias[expert]
        expert_down_bias = None if down_bias is None else down_bias[expert]
        h = expert_activation(matmul(rows[start:end], gate_up[expert], expert_gate_up_bias), activation, limit, alpha)
        out_rows[start:end] = matmul(h, down[expert], expert_down_bias)
        start = end
    out_rows = out_rows * weights.reshape(-1)[order, None]
    out = torch.zeros_like(x)
    out.index_add_(0, token_of_row, out_rows.to(x.dtype))
    return out


def sum_over_choices(per_choice: torch.Tensor) -> torch.Tensor:
    """[T, k, hidden] -> [T, hidden]: a token's k expert outputs added in choice order,
    one elementwise add after another, so that the sum never depends on the batch (a
    reduction kernel may split or order it by the tensor's size)."""
    total = per_choice[:, 0]
    for choice in range(1, per_choice.shape[1]):
        total = total + per_choice[:, choice]
    return total


class Experts(nn.Module):
    """The routed experts, stacked: ``gate_up_proj`` [E, 2I, hidden] and ``down_proj``
    [E, hidden, I] (each expert's slice is an ``F.linear`` weight), with biases
    [E, 2I] and [E, hidden] where the family has them.

    Gate and up are halves (rows [0, I) and [I, 2I)) for SiLU experts, as
    transformers' fused tensors; interleaved row by row for GPT-OSS, as its
    checkpoint's columns, so that its fused tensors load as transposed views."""

    def __init__(
        self, hidden: int, moe: MoEConfig, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS
    ) -> None:
        super().__init__()
        self.moe = moe
        self._fused_moe = ops.fused_moe
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = _parameter((e, 2 * i, hidden), dtype, device)
        self.down_proj = _parameter((e, hidden, i), dtype, device)
        self.gate_up_proj_bias = _parameter((e, 2 * i), dtype, device) if moe.expert_bias else None
        self.down_proj_bias = _parameter((e, hidden), dtype, device) if moe.expert_bias else None
        self.dtype = dtype
        self.mxfp4 = False
        self._fused_moe_mxfp4: Kernel | None = None

    def keep_mxfp4(self, kernel: Kernel | None) -> None:
        """Hold the weights packed as MXFP4 from now on (the loader calls it before reading
        them: shared/model/kept_weights.py): ``gate_up_blocks`` uint8 [E, 2I, hidden / 2] and
        ``gate_up_scales`` [E, 2I, hidden / 32], ``down_blocks`` [E, hidden, I / 2] and
        ``down_scales`` [E, hidden, I / 32], rows as the float weights' (the checkpoint's
        ``*_blocks`` / ``*_scales`` flattened); the float weights are freed. ``kernel``: the
        ops table's ``fused_moe_mxfp4``; None dequantises each forward (the reference)."""
        e, two_i, hidden = self.gate_up_proj.shape
        i, device = two_i // 2, self.gate_up_proj.device
        if hidden % FP4_GROUP or i % FP4_GROUP:
            raise ValueError(f"MXFP4 experts need hidden ({hidden}) and intermediate ({i}) sizes in groups of {FP4_GROUP}")
        del self.gate_up_proj, self.down_proj
        for part, (rows, cols) in {"gate_up": (two_i, hidden), "down": (hidden, i)}.items():
            self.register_buffer(f"{part}_blocks", torch.empty(e, rows, cols // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{part}_scales", torch.empty(e, rows, cols // FP4_GROUP, dtype=torch.uint8, device=device))
        self.mxfp4 = True
        self._fused_moe_mxfp4 = kernel

    @property
    def host_sync_free(self) -> bool:
        """Whether a forward never reads the device from the host (the fused path)."""
        if self.mxfp4:
            return self._fused_moe_mxfp4 is not None
        # A kernel may say it syncs (batch-invariant mode's PyTorch experts do).
        return self._fused_moe is not None and getattr(self._fused_moe, "host_sync_free", True)

    def stacked(self) -> dict[str, torch.Tensor]:
        """The stacked weights by attribute name (``gate_up_proj``, ``down_proj`` and the
        biases where the family has them), each [E, ...]."""
        if self.mxfp4:
            raise ValueError("experts kept packed in MXFP4 cannot be split or moved: load them dequantised")
        names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
        return {name: getattr(self, name).detach() for name in names if getattr(self, name) is not None}

    def select(self, experts: torch.Tensor) -> "Experts":
        """A new Experts holding copies of ``experts`` [n] (expert ids, repeats allowed)
        as its experts 0 .. n-1, with this one's kernel: an expert-parallel rank's slots
        (shared/model/expert_parallel.py)."""
        stacked = self.stacked()
        gate_up = stacked["gate_up_proj"]
        moe = dataclasses.replace(self.moe, num_experts=len(experts), top_k=1)
        chosen = Experts(gate_up.shape[2], moe, self.dtype, gate_up.device)
        chosen._fused_moe = self._fused_moe
        index = experts.to(gate_up.device)
        for name, whole in stacked.items():
            getattr(chosen, name).copy_(whole.index_select(0, index))
        return chosen

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return expert_activation(gate_up, self.moe.activation, self.moe.swiglu_limit, self.moe.swiglu_alpha)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids and weights [T, k] -> sum over the k choices of weight * expert(x)."""
        moe = self.moe
        if self.mxfp4:
            return self._forward_mxfp4(x, ids, weights)
        if self._fused_moe is not None:
            return self._fused_moe(
                x, self.gate_up_proj, self.down_proj, ids, weights,
                gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                activation=moe.activation, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
            )  # fmt: skip
        return experts_reference(
            x, ids, weights, self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias,
            moe.activation, moe.swiglu_limit, moe.swiglu_alpha,
        )  # fmt: skip

    def _forward_mxfp4(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        packed = (self.gate_up_blocks, self.gate_up_scales, self.down_blocks, self.down_scales)
        if self._fused_moe_mxfp4 is not None:
            return self._fused_moe_mxfp4(
                x, *packed, ids, weights, gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                activation=moe.activation, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
            )  # fmt: skip
        # The reference: decoded as the loader decodes (exact in the model dtype), then the PyTorch path.
        gate_up = dequantize_fp4_groups(self.gate_up_blocks.cpu(), self.gate_up_scales.cpu()).to(x.device, self.dtype)
        down = dequantize_fp4_groups(self.down_blocks.cpu(), self.down_scales.cpu()).to(x.device, self.dtype)
        return experts_reference(
            x, ids, weights, gate_up, down, self.gate_up_proj_bias, self.down_proj_bias,
            moe.activation, moe.swiglu_limit, moe.swiglu_alpha,
        )  # fmt: skip

    def _packed_targets(self, prefix: str, available: Collection[str] | None) -> dict[str, torch.Tensor]:
        """``checkpoint_targets`` once packed (``keep_mxfp4``): the loader copies the stored
        bytes as they are, fused (GPT-OSS's ``_blocks``, rows already the model's) or per
        expert (DeepSeek-V4's FP4 ``w1``/``w3``/``w2``: rows of the stacked blocks)."""
        targets: dict[str, torch.Tensor] = {}
        if self.moe.activation == "gpt_oss" or (available is not None and f"{prefix}.gate_up_proj" in available):
            targets = {f"{prefix}.gate_up_proj": self.gate_up_blocks, f"{prefix}.down_proj": self.down_blocks}
        else:
            i = self.moe.intermediate_size
            for e in range(self.moe.num_experts):
                targets[f"{prefix}.{e}.gate_proj.weight"] = self.gate_up_blocks[e, :i]
                targets[f"{prefix}.{e}.up_proj.weight"] = self.gate_up_blocks[e, i:]
                targets[f"{prefix}.{e}.down_proj.weight"] = self.down_blocks[e]
        if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
            if f"{prefix}.gate_up_proj" in targets:
                targets[f"{prefix}.gate_up_proj_bias"] = self.gate_up_proj_bias.detach()
                targets[f"{prefix}.down_proj_bias"] = self.down_proj_bias.detach()
            else:
                i = self.moe.intermediate_size
                for e in range(self.moe.num_experts):
                    targets[f"{prefix}.{e}.gate_proj.bias"] = self.gate_up_proj_bias.detach()[e, :i]
                    targets[f"{prefix}.{e}.up_proj.bias"] = self.gate_up_proj_bias.detach()[e, i:]
                    targets[f"{prefix}.{e}.down_proj.bias"] = self.down_proj_bias.detach()[e]
        return targets

    def packed_scales_of(self, blocks: torch.Tensor) -> torch.Tensor | None:
        """The scales of a view of the packed blocks (a ``checkpoint_targets`` tensor): the
        same expert and rows of ``gate_up_scales`` or ``down_scales``; None if it is not one."""
        if not self.mxfp4:
            return None
        for whole, scales in ((self.gate_up_blocks, self.gate_up_scales), (self.down_blocks, self.down_scales)):
            offset = blocks.data_ptr() - whole.data_ptr()
            if blocks.dtype != torch.uint8 or not 0 <= offset < whole.numel():
                continue
            expert, row = offset // whole.stride(0), offset % whole.stride(0) // whole.stride(1)
            if blocks.dim() == 3:
                return scales
            return scales[expert, row : row + blocks.shape[0]]
        return None

    def checkpoint_targets(self, prefix: str, available: Collection[str] | None) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the tensor (or view) it is copied into. Fused tensors
        (``prefix.gate_up_proj``...) when the checkpoint has them or the family only
        has those (GPT-OSS); else per-expert ``prefix.<e>.gate_proj.weight``..."""
        if self.mxfp4:
            return self._packed_targets(prefix, available)
        gate_up, down = self.gate_up_proj.detach(), self.down_proj.detach()
        if self.moe.activation == "gpt_oss":
            # GPT-OSS stores x @ W: [E, hidden, 2I] (gate, up interleaved) and [E, I, hidden].
            targets = {f"{prefix}.gate_up_proj": gate_up.transpose(1, 2), f"{prefix}.down_proj": down.transpose(1, 2)}
            if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
                targets[f"{prefix}.gate_up_proj_bias"] = self.gate_up_proj_bias.detach()
                targets[f"{prefix}.down_proj_bias"] = self.down_proj_bias.detach()
            return targets
        if available is not None and f"{prefix}.gate_up_proj" in available:
            targets = {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}
            if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
                targets[f"{prefix}.gate_up_proj_bias"] = self.gate_up_proj_bias.detach()
                targets[f"{prefix}.down_proj_bias"] = self.down_proj_bias.detach()
            return targets
        i = self.moe.intermediate_size
        targets = {}
        for e in range(self.moe.num_experts):
            targets[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :i]
            targets[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, i:]
            targets[f"{prefix}.{e}.down_proj.weight"] = down[e]
            if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
                targets[f"{prefix}.{e}.gate_proj.bias"] = self.gate_up_proj_bias.detach()[e, :i]
                targets[f"{prefix}.{e}.up_proj.bias"] = self.gate_up_proj_bias.detach()[e, i:]
                targets[f"{prefix}.{e}.down_proj.bias"] = self.down_proj_bias.detach()[e]
        return targets


class SharedExperts(nn.Module):
    """The always-on experts as one SiLU MLP (DeepSeek's ``shared_experts``), clamped by
    ``swiglu_limit`` like the routed ones. ``parallel``: split by intermediate columns
    over its ranks as a dense MLP is (gate and up column-parallel, down row-parallel:
    each rank's output is the whole sum after down_proj's all-reduce)."""

    def __init__(
        self, hidden: int, moe: MoEConfig, dtype: torch.dtype, device: torch.device, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        size = moe.shared_intermediate_size
        self.gate_up_proj: MergedLinear
        self.down_proj: Linear
        if parallel.is_parallel:
            part = column_shard(size, parallel, "the shared experts' intermediate size")
            self.gate_up_proj = MergedColumnParallelLinear(hidden, {"gate_proj": part, "up_proj": part}, False, dtype,
                                                           device)  # fmt: skip
            self.down_proj = RowParallelLinear(size, hidden, False, dtype, device, TORCH_OPS, parallel,
                                               "the shared experts' intermediate size")  # fmt: skip
        else:
            self.gate_up_proj = MergedLinear(hidden, {"gate_proj": size, "up_proj": size}, False, dtype, device)
            self.down_proj = Linear(size, hidden, False, dtype, device)
        self.limit = moe.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_gate(self.gate_up_proj(x), self.limit))


def counted_tokens(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor | None:
    """[T] int64, 1 for the rows that are real tokens, or None when all are (nothing
    computed). A CUDA graph's padding rows are sequences of one query and no key
    (seq_len 0, ``DecodeGraphs``), which no real token is: read from the device
    lengths, so a replay counts the batch it replays, not the bucket it was captured at."""
    if meta.seq_lens_tensor is None or meta.num_seqs != num_tokens:
        return None  # eager batches carry no padding rows
    return (meta.seq_lens_tensor > 0).to(torch.int64)


class SparseMoE(nn.Module):
    """One sparse MLP: the router (under ``router_name``: Qwen's ``gate``, GPT-OSS's
    ``router``), the routed ``experts`` and, where configured, ``shared_experts``.
    ``ops.fused_moe``: the experts take the fused path (no host sync).

    ``counts`` (set by the model: a row of its ``expert_counts``) receives the
    number of (token, choice) pairs each expert got in the last forward."""

    def __init__(
        self,
        hidden: int,
        moe: MoEConfig,
        layer_type: MlpLayerType,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        router_name: str = "gate",
        ops: Ops = TORCH_OPS,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        """``parallel``: the shared experts' split (``SharedExperts``); the routed experts
        are built whole whatever it says (expert parallelism keeps a rank's afterwards)."""
        super().__init__()
        if layer_type == "dense":
            raise ValueError("a dense layer has no experts")
        self.router_name = router_name
        self.add_module(router_name, Router(hidden, moe, vocab_size, layer_type == "hash_moe", dtype, device))
        self.experts = Experts(hidden, moe, dtype, device, ops)
        self.shared_experts = SharedExperts(hidden, moe, dtype, device, parallel) if moe.num_shared_experts else None
        self.counts: torch.Tensor | None = None

    @property
    def host_sync_free(self) -> bool:
        """Whether a forward can be captured in a CUDA graph (routing, counting and the
        shared experts never sync; the experts do unless fused)."""
        return self.experts.host_sync_free

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None, counted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``counted``: [T] 0/1, the rows to count in ``counts`` (``counted_tokens``); None: all."""
        router: Router = getattr(self, self.router_name)
        with profiled("moe.router"):
            weights, ids = router(x, input_ids)
        if self.counts is not None:
            flat = ids.reshape(-1)
            ones = torch.ones_like(flat) if counted is None else counted[:, None].expand(ids.shape).reshape(-1)
            # scatter_add_ rather than bincount: bincount sizes its output on the host (a sync).
            self.counts.zero_()
            self.counts.scatter_add_(0, flat, ones.to(self.counts.dtype))
        with profiled("moe.experts"):
            out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            with profiled("moe.shared_experts"):
                out = out + self.shared_experts(x)
        return out
