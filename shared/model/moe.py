"""Mixture-of-experts layers shared by the MoE families: the router, the experts
stored stacked ``[num_experts, ...]``, shared experts, and the block that joins them
under the checkpoint's names. ``MoEConfig`` (shared/model/moe_config.py) says which
variant each family uses.

The PyTorch path sorts the (token, choice) pairs by expert and runs one matmul per
projection per active expert on its contiguous run of rows. It needs the run
lengths on the host, so it syncs once per layer: fine on the CPU, not graph
capturable. Each forward also counts tokens per expert on the device into a row of
the model's ``expert_counts`` (no sync), for balancing.
"""

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.layers import MergedLinear, Linear
from shared.model.moe_config import MlpLayerType, MoEConfig


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

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
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


class Experts(nn.Module):
    """The routed experts, stacked: ``gate_up_proj`` [E, 2I, hidden] and ``down_proj``
    [E, hidden, I] (each expert's slice is an ``F.linear`` weight), with biases
    [E, 2I] and [E, hidden] where the family has them.

    Gate and up are halves (rows [0, I) and [I, 2I)) for SiLU experts, as
    transformers' fused tensors; interleaved row by row for GPT-OSS, as its
    checkpoint's columns, so that its fused tensors load as transposed views."""

    def __init__(self, hidden: int, moe: MoEConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.moe = moe
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = _parameter((e, 2 * i, hidden), dtype, device)
        self.down_proj = _parameter((e, hidden, i), dtype, device)
        self.gate_up_proj_bias = _parameter((e, 2 * i), dtype, device) if moe.expert_bias else None
        self.down_proj_bias = _parameter((e, hidden), dtype, device) if moe.expert_bias else None

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.moe.activation == "gpt_oss":
            assert self.moe.swiglu_limit is not None
            return gpt_oss_gate(gate_up, self.moe.swiglu_alpha, self.moe.swiglu_limit)
        return silu_gate(gate_up, self.moe.swiglu_limit)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids and weights [T, k] -> sum over the k choices of weight * expert(x)."""
        num_tokens, k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.sort(flat_ids, stable=True).indices  # (token, choice) pairs grouped by expert
        token_of_row = order // k
        rows = x[token_of_row]
        out_rows = torch.empty_like(rows)
        # The host needs the run lengths to slice: the one sync of this path.
        run_lengths = torch.bincount(flat_ids, minlength=self.moe.num_experts).tolist()
        start = 0
        for expert, n in enumerate(run_lengths):
            if n == 0:
                continue
            end = start + n
            gate_up_bias = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[expert]
            down_bias = None if self.down_proj_bias is None else self.down_proj_bias[expert]
            h = self.activation(F.linear(rows[start:end], self.gate_up_proj[expert], gate_up_bias))
            out_rows[start:end] = F.linear(h, self.down_proj[expert], down_bias)
            start = end
        out_rows = out_rows * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x)
        out.index_add_(0, token_of_row, out_rows.to(x.dtype))
        return out

    def checkpoint_targets(self, prefix: str, available: Collection[str] | None) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the tensor (or view) it is copied into. Fused tensors
        (``prefix.gate_up_proj``...) when the checkpoint has them or the family only
        has those (GPT-OSS); else per-expert ``prefix.<e>.gate_proj.weight``..."""
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
    ``swiglu_limit`` like the routed ones."""

    def __init__(self, hidden: int, moe: MoEConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size = moe.shared_intermediate_size
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": size, "up_proj": size}, False, dtype, device)
        self.down_proj = Linear(size, hidden, False, dtype, device)
        self.limit = moe.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_gate(self.gate_up_proj(x), self.limit))


class SparseMoE(nn.Module):
    """One sparse MLP: the router (under ``router_name``: Qwen's ``gate``, GPT-OSS's
    ``router``), the routed ``experts`` and, where configured, ``shared_experts``.

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
    ) -> None:
        super().__init__()
        if layer_type == "dense":
            raise ValueError("a dense layer has no experts")
        self.router_name = router_name
        self.add_module(router_name, Router(hidden, moe, vocab_size, layer_type == "hash_moe", dtype, device))
        self.experts = Experts(hidden, moe, dtype, device)
        self.shared_experts = SharedExperts(hidden, moe, dtype, device) if moe.num_shared_experts else None
        self.counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        router: Router = getattr(self, self.router_name)
        weights, ids = router(x, input_ids)
        if self.counts is not None:
            # scatter_add_ rather than bincount: bincount sizes its output on the host (a sync).
            self.counts.zero_()
            self.counts.scatter_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1), dtype=self.counts.dtype))
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
