"""Qwen3-MoE's config (torch-free, beside models/qwen3_moe.py): Qwen3's attention
traits, which layers are sparse and their experts (``qwen3_moe_experts``), and the
keys transformers 5.24 writes into its config.json (``hf_test_config``)."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from shared.model.arch_config import ArchConfig, ArchTraits
from shared.model.moe_config import TEST_EXPERTS, MlpLayerType, MoEConfig


def qwen3_moe_experts(d: Mapping[str, Any], num_layers: int) -> tuple[MoEConfig | None, tuple[MlpLayerType, ...]]:
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


def parse_fields(d: Mapping[str, Any], num_layers: int, head_dim: int, max_pos: int) -> Mapping[str, Any]:
    moe, kinds = qwen3_moe_experts(d, num_layers)
    return {"moe": moe, "mlp_layer_types": () if moe is None else kinds}


def hf_test_config(model_type: str, config: dict[str, Any], preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """Experts of TEST_EXPERTS in every layer but the last (``mlp_only_layers``), so a
    checkpoint has both kinds; ``sliding_window`` W: every layer sliding."""
    config.update({
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [preset["num_hidden_layers"] - 1],
        "moe_intermediate_size": TEST_EXPERTS["moe_intermediate_size"],
        "norm_topk_prob": True,
        "num_experts_per_tok": TEST_EXPERTS["num_experts_per_tok"],
        "num_local_experts": TEST_EXPERTS["num_experts"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
    })  # fmt: skip
    return config


CONFIG = ArchConfig(
    architectures=MappingProxyType(
        # Qwen3's attention; a window (when enabled) on every layer.
        {"Qwen3MoeForCausalLM": ArchTraits("qwen3_moe", None, None, False, True, "all_if_enabled", None)}
    ),
    test_config=hf_test_config,
    parse=parse_fields,
)
