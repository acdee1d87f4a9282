"""What a mixture-of-experts layer computes, parsed from ``config.json`` (torch-free:
the balancer reads configs without torch).

One ``MoEConfig`` describes the router and the experts of every MoE family we load;
the families differ only in data, which each reads in its own config module
(shared/model/models/<name>_config.py):

- Qwen3-MoE: softmax over all experts, top-k, optional renormalisation
  (``norm_topk_prob``), SiLU-gated experts with gate and up halves.
- GPT-OSS: top-k of the raw logits (router with a bias), softmax over the k chosen;
  experts with biases and the clamped ``(up + 1) * gate * sigmoid(alpha * gate)``
  activation, gate and up interleaved column by column in the checkpoint.
- DeepSeek-V4: sigmoid or ``sqrtsoftplus`` scores, a
  selection-only bias (``e_score_correction_bias``), renormalisation with an
  epsilon, a routed scaling factor, hash routing (``tid2eid[input_ids]``) in its
  first layers, shared experts, and the ``swiglu_limit`` clamp on SiLU experts.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

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


# The MoE families' experts in make-model's test configs, whatever the preset: small
# enough to draw fast on the CPU, enough experts that routing matters.
TEST_EXPERTS: Mapping[str, int] = MappingProxyType(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128))
