"""What DeepSeek-V4's attention and residual stream compute, parsed from ``config.json``
(torch-free, like shared/model/config.py which holds it in ``ModelConfig.deepseek_v4``).

Read as transformers 5.24's ``DeepseekV4Config`` reads it: ``layer_types`` (or the
legacy per-layer ``compress_ratios``), ``compress_rates`` per attention kind (or the
legacy ``compress_rate_csa``/``compress_rate_hca``), ``mlp_layer_types`` (or
``num_hash_layers``), ``partial_rotary_factor`` (or ``qk_rope_head_dim``), and the two
rotaries: "main" for sliding-only layers, "compress" (YaRN where configured) for the
compressed layers, their compressors and the indexer.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shared.model.moe_config import MlpLayerType, MoEConfig

V4LayerType = Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
SLIDING: V4LayerType = "sliding_attention"
CSA: V4LayerType = "compressed_sparse_attention"
HCA: V4LayerType = "heavily_compressed_attention"
V4_LAYER_TYPES: tuple[V4LayerType, ...] = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE: Mapping[int, V4LayerType] = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES: Mapping[str, int] = {CSA: 4, HCA: 128}


@dataclass(frozen=True, slots=True)
class DeepseekV4Params:
    """V4's attention, compressors, indexer and hyper-connections (the MoE is a MoEConfig)."""

    layer_types: tuple[V4LayerType, ...]
    compress_rates: tuple[int, ...]
    """Per layer: tokens per compressed entry (4 for CSA, 128 for HCA), 0 for sliding-only."""
    q_lora_rank: int
    rope_head_dim: int
    """The trailing channels of each 512-wide head that carry rope (64 in the real model)."""
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        for kind, rate in zip(self.layer_types, self.compress_rates):
            if kind != SLIDING and rate < 1:
                raise ValueError(f"compress_rates[{kind!r}] must be at least 1, got {rate}")
        if self.rope_head_dim % 2:
            raise ValueError(f"the rope part of a head must be even, got {self.rope_head_dim}")

    def layer_type(self, layer_idx: int) -> V4LayerType:
        return self.layer_types[layer_idx]

    def uses_compress_rope(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] != SLIDING

    @property
    def state_window(self) -> int:
        """Raw tokens of per-request state a query needs behind it: the sliding window,
        and the compressors' unfinished windows (2 m for CSA's overlapping windows, m for HCA)."""
        needs = [self.sliding_window]
        for kind, rate in zip(self.layer_types, self.compress_rates):
            needs.append(2 * rate if kind == CSA else rate if kind == HCA else 0)
        return max(needs)


def parse_deepseek_v4(d: Mapping[str, Any], num_layers: int, head_dim: int) -> DeepseekV4Params:
    rates = dict(_DEFAULT_RATES)
    rates.update(d.get("compress_rates") or {})
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = int(d["compress_rate_csa"])
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = int(d["compress_rate_hca"])
    layer_types = d.get("layer_types")
    if layer_types is None and d.get("compress_ratios") is not None:
        layer_types = [_RATIO_TO_TYPE[int(r)] for r in d["compress_ratios"]]
    if layer_types is None:  # transformers' default: 2 HCA, then CSA and HCA interleaved
        layer_types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    layer_types = list(layer_types)[:num_layers]
    if len(layer_types) != num_layers or any(t not in V4_LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must be {num_layers} of {V4_LAYER_TYPES}, got {layer_types}")
    partial = d.get("partial_rotary_factor")
    if partial is None:
        partial = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") else 64 / 512
    return DeepseekV4Params(
        layer_types=tuple(layer_types),
        compress_rates=tuple(0 if t == SLIDING else int(rates[t]) for t in layer_types),
        q_lora_rank=int(d.get("q_lora_rank", 1024)),
        rope_head_dim=int(head_dim * float(partial)),
        sliding_window=int(d.get("sliding_window", 128)),
        o_groups=int(d.get("o_groups", 8)),
        o_lora_rank=int(d.get("o_lora_rank", 1024)),
        index_n_heads=int(d.get("index_n_heads", 64)),
        index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
    )


def deepseek_v4_moe(d: Mapping[str, Any], num_layers: int) -> tuple[MoEConfig, tuple[MlpLayerType, ...]]:
    """Every layer sparse: the first ``num_hash_layers`` (or those ``mlp_layer_types``
    names) hash-routed; scores renormalised with an epsilon of 1e-20 and scaled, a
    selection-only bias on the learned routers, one shared SiLU expert of the routed
    experts' size (as transformers' DeepseekV4MLP), the ``swiglu_limit`` clamp."""
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        num_hash = int(d.get("num_hash_layers", 3))
        kinds = ["hash_moe"] * min(num_layers, num_hash) + ["moe"] * max(0, num_layers - num_hash)
    kinds = list(kinds)[:num_layers]
    if len(kinds) != num_layers or any(k not in ("hash_moe", "moe") for k in kinds):
        raise ValueError(f"mlp_layer_types must be {num_layers} of ('hash_moe', 'moe'), got {kinds}")
    size = int(d.get("moe_intermediate_size", 2048))
    limit = d.get("swiglu_limit", 10.0)
    moe = MoEConfig(
        num_experts=int(d.get("n_routed_experts", d.get("num_local_experts", 256))),
        top_k=int(d.get("num_experts_per_tok", 6)),
        intermediate_size=size,
        scoring=d.get("scoring_func", "sqrtsoftplus"),
        norm_topk_prob=True,
        renorm_eps=1e-20,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        selection_bias=True,
        swiglu_limit=None if limit is None else float(limit),
        num_shared_experts=int(d.get("n_shared_experts", 1)),
        shared_intermediate_size=size,
    )
    return moe, tuple(kinds)  # type: ignore[arg-type]
