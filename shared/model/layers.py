"""The small building blocks of a Llama-family layer, written to match transformers'
Llama code operation for operation so float32 results agree to rounding."""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.arch_config import RopeConfig
from shared.model.ops import TORCH_OPS, Ops


class Linear(nn.Module):
    """``nn.Linear`` with the same parameter names but allocated empty in the target
    dtype and device: the weights always come from a checkpoint, so a random init
    would only cost time (minutes for a large model).

    ``ops.gemv``: a single row (batch-1 decode) goes through it (the Triton GEMV,
    shared/model/kernels/gemv.py, streams the weight faster than cuBLAS does for one
    row); more rows are cuBLAS's.

    ``fp8_keepable``: whether the loader may replace this module by an ``Fp8Linear``
    when its checkpoint weight is FP8 and FP8 is kept (shared/model/kept_weights.py);
    False for a linear whose weight the model reads directly rather than calling it."""

    fp8_keepable: bool = True

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
        ops: Ops = TORCH_OPS,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self._gemv = ops.gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._gemv)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: Callable[..., torch.Tensor] | None
) -> torch.Tensor:
    """``F.linear``, or ``gemv`` (the Triton kernel, when the model uses Triton) for a single row;
    a row kernel marked ``any_rows`` (batch_invariant.py's) takes every input."""
    if gemv is not None and (getattr(gemv, "any_rows", False) or (x.dim() == 2 and x.shape[0] == 1)):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class MergedLinear(Linear):
    """Projections of the same input stacked into one weight (q, k, v or gate, up): at
    decode sizes a matmul costs one read of its weight plus a launch, so one launch
    over the stacked weight beats several over the parts.

    Checkpoints keep the parts apart: ``shards`` maps each part's name (``q_proj``...)
    to its number of output rows, in order; ``shard_views`` gives where each goes.
    """

    def __init__(
        self, in_features: int, shards: dict[str, int], bias: bool, dtype: torch.dtype, device: torch.device,
        ops: Ops = TORCH_OPS,
    ) -> None:  # fmt: skip
        super().__init__(in_features, sum(shards.values()), bias, dtype, device, ops)
        self.shards = dict(shards)

    def shard_views(self) -> dict[str, torch.Tensor]:
        """``"q_proj.weight"`` (and ``.bias``) -> that part's rows of the stacked tensors."""
        views: dict[str, torch.Tensor] = {}
        start = 0
        for name, rows in self.shards.items():
            views[f"{name}.weight"] = self.weight.detach()[start : start + rows]
            if self.bias is not None:
                views[f"{name}.bias"] = self.bias.detach()[start : start + rows]
            start += rows
        return views

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The parts of this projection's output, as views (no copy)."""
        return list(out.split(list(self.shards.values()), dim=-1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As LlamaRMSNorm: normalise in float32, cast back, then scale in the input dtype.
    A float32 weight on a narrower x is GptOssRMSNorm's (and DeepSeek-V4's) order
    instead: scaled in float32, cast once."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (weight * h).to(input_dtype)
    return weight * h.to(input_dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """``ops.rmsnorm`` runs instead where the table has one (shared/model/kernels/rmsnorm.py).
    ``scale_in_float32``: the weight kept in float32 and applied before the one cast
    back (GPT-OSS: transformers' GptOssRMSNorm), not after it (Llama)."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        scale_in_float32: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        weight_dtype = torch.float32 if scale_in_float32 else dtype
        self.weight = nn.Parameter(torch.ones(size, dtype=weight_dtype, device=device), requires_grad=False)
        self.eps = eps
        self._triton = ops.rmsnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton is not None:
            return self._triton.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def fused_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, fused into the norm on the Triton path."""
        if self._triton is not None:
            return self._triton.fused_add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x


class MLP(nn.Module):
    """SiLU-gated feed-forward: down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS
    ) -> None:
        super().__init__()
        shards = {"gate_proj": intermediate, "up_proj": intermediate}
        self.gate_up_proj = MergedLinear(hidden, shards, bias, dtype, device, ops)
        self.down_proj = Linear(intermediate, hidden, bias, dtype, device, ops)
        self._act = ops.activation or silu_and_mul
        # Batch-1 decode on the Triton path: the activation computed inside the down GEMV.
        self._gated_gemv = ops.gated_gemv
        # The fused batch-1 path reads down_proj's weight as floats: never FP8 there.
        self.down_proj.fp8_keepable = self._gated_gemv is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self._gated_gemv is not None and gate_up.shape[0] == 1:
            return self._gated_gemv(gate_up, self.down_proj.weight, self.down_proj.bias, gated=True)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self._act(gate, up))


def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, computed as modeling_rope_utils does
    (same op order, so the same float32 rounding)."""
    base = rope.rope_theta
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        assert rope.factor is not None
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    assert rope.rope_type == "llama3"
    assert rope.factor is not None and rope.low_freq_factor is not None and rope.high_freq_factor is not None
    assert rope.original_max_position_embeddings is not None
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended smoothly.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv_freq_extrapolation: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolated (slowed by ``factor``) frequencies for long wavelengths, the
    original ones for short wavelengths, a linear ramp between the correction dims."""
    assert rope.factor is not None and rope.original_max_position_embeddings is not None
    assert rope.beta_fast is not None and rope.beta_slow is not None
    base, dim, original = rope.rope_theta, head_dim, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    device = inv_freq_extrapolation.device
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim)
    inv_freq_interpolation = 1.0 / (rope.factor * pos_freqs)
    return (
        inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions, neox layout (two halves), like LlamaRotaryEmbedding.

    ``inv_freq`` stays float32 whatever the model dtype, as in transformers; build the
    model in its dtype rather than calling ``.to(dtype)`` on it, which would round it.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim, device), persistent=False)
        # YaRN scales cos and sin (transformers' attention_scaling) before the cast.
        self.attention_factor = rope.attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor is not None:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary (M-RoPE, Qwen2-VL's and Qwen2.5-VL's): positions [3, T]
    (temporal, height, width; shared/model/vision/mrope.py), the first ``sections[0]``
    frequency pairs turned by the temporal position, the next ``sections[1]`` by the
    height, the last by the width (contiguous sections), as Qwen2_5_VLRotaryEmbedding;
    ``interleaved``: Qwen3-VL's layout instead (``mrope_axes``).
    Positions [T] (every axis alike: text, decode) are the plain rope."""

    def __init__(self, rope: RopeConfig, head_dim: int, sections: tuple[int, int, int], device: torch.device,
                 interleaved: bool = False) -> None:  # fmt: skip
        super().__init__(rope, head_dim, device)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"M-RoPE sections {sections} must sum to head_dim / 2 = {head_dim // 2}")
        axis = torch.tensor(mrope_axes(sections, interleaved), device=device)
        self.axis_of_pair: torch.Tensor
        self.register_buffer("axis_of_pair", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        # Pair i reads its axis's position: the same products transformers takes before it
        # picks each section from the axis's table.
        freqs = positions[self.axis_of_pair].t().float() * self.inv_freq.float()  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_axes(sections: tuple[int, int, int], interleaved: bool) -> list[int]:
    """The axis (0 temporal, 1 height, 2 width) of each rotary pair. Contiguous: the
    sections one after another. Interleaved (Qwen3VLTextRotaryEmbedding's
    recomposition): pairs 1, 4, 7... below 3 x sections[1] are the height's, pairs 2, 5,
    8... below 3 x sections[2] the width's, every other pair the temporal's."""
    if not interleaved:
        return [a for a, n in enumerate(sections) for _ in range(n)]
    axes = [0] * sum(sections)
    for axis in (1, 2):
        for i in range(axis, min(3 * sections[axis], len(axes)), 3):
            axes[i] = axis
    return axes


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim], shared by all heads."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)
