"""What a mixture-of-experts layer computes, parsed from ``config.json`` (torch-free:
the balancer reads configs without torch).

One ``MoEConfig`` describes the router and the experts of every MoE family we load;
the families differ only in data:

- Qwen3-MoE: softmax over all experts, top-k, optional renormalisation
  (``norm_topk_prob``), SiLU-gated experts with gate and up halves.
- GPT-OSS: top-k of the raw logits (router with a bias), softmax over the k chosen;
  experts with biases and the clamped ``(up + 1) * gate * sigmoid(alpha * gate)``
  activation, gate and up interleaved column by column in the checkpoint.
- DeepSeek-V4 (not wired to a model yet): sigmoid or ``sqrtsoftplus`` scores, a
  selection-only bias (``e_score_correction_bias``), renormalisation with an
  epsilon, a routed scaling factor, hash routing (``tid2eid[input_ids]``) in its
  first layers, shared experts, and the ``swiglu_limit`` clamp on SiLU experts.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"]
"""How router logits become expert scores: softmax/sigmoid/sqrt(softplus) over every
expert, then top-k of the scores; ``softmax_topk`` (GPT-OSS) takes the top-k of the
raw logits and a softmax over those k only."""
ExpertActivation = Literal["silu", "gpt_oss"]
MlpLayerType = Literal["dense", "moe", "hash_moe"]
SCORINGS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus", "softmax_topk")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    """Each routed expert's hidden size (Qwen3-MoE's ``moe_intermediate_size``)."""
    scoring: Scoring = "softmax"
    norm_topk_prob: bool = False
    """Renormalise the k chosen weights to sum to 1."""
    renorm_eps: float = 0.0
    """Added to the sum when renormalising (DeepSeek-V4 adds 1e-20)."""
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    """A bias on the router's logits (GPT-OSS ``mlp.router.bias``)."""
    selection_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only, never to their
    weights (DeepSeek's ``e_score_correction_bias``)."""
    expert_bias: bool = False
    """Biases on the experts' projections (GPT-OSS)."""
    activation: ExpertActivation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    """Clamp of gate (above) and up (both sides) before the activation; None: none."""
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    """All shared experts as one SiLU MLP of this size (added to the routed output)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring {self.scoring!r} is not supported; supported: {', '.join(SCORINGS)}")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be at least 1, got {self.intermediate_size}")


def qwen3_moe(d: Mapping[str, Any], num_layers: int) -> tuple[MoEConfig | None, tuple[MlpLayerType, ...]]:
    """Qwen3-MoE: layer i is sparse unless listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` (as Qwen3MoeDecoderLayer decides); no experts: all dense."""
    # transformers saves num_experts as num_local_experts (Qwen3MoeConfig.attribute_map).
    num_experts = int(d.get("num_experts", d.get("num_local_experts", 128)))
    step = int(d.get("decoder_sparse_step", 1))
    mlp_only = set(d.get("mlp_only_layers") or [])
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {step}")
    if any(not 0 <= i < num_layers for i in mlp_only):
        raise ValueError(f"mlp_only_layers {sorted(mlp_only)} must be layer indices below {num_layers}")
    kinds: tuple[MlpLayerType, ...] = tuple(
        "moe" if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 else "dense" for i in range(num_layers)
    )
    if "moe" not in kinds:
        return None, ("dense",) * num_layers
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=int(d.get("num_experts_per_tok", 8)),
        intermediate_size=int(d.get("moe_intermediate_size", 768)),
        scoring="softmax",
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
    )
    return moe, kinds


def gpt_oss(d: Mapping[str, Any], num_layers: int) -> tuple[MoEConfig, tuple[MlpLayerType, ...]]:
    """GPT-OSS: every layer's MLP is sparse; experts of ``intermediate_size``."""
    moe = MoEConfig(
        num_experts=int(d.get("num_local_experts", 128)),
        top_k=int(d.get("num_experts_per_tok", 4)),
        intermediate_size=int(d.get("intermediate_size", 2880)),
        scoring="softmax_topk",
        router_bias=True,
        expert_bias=True,
        activation="gpt_oss",
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
    )
    return moe, ("moe",) * num_layers
