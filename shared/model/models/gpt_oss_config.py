"""GPT-OSS's config (torch-free, beside models/gpt_oss.py): its attention traits
(biased q/k/v/o, sliding and full layers from ``layer_types``, sinks), its experts
(``gpt_oss_experts``), and the keys transformers 5.24 writes into its config.json
(``hf_test_config``)."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from shared.model.arch_config import ArchConfig, ArchTraits
from shared.model.moe_config import TEST_EXPERTS, MlpLayerType, MoEConfig

TEST_SLIDING_WINDOW = 128  # GptOssConfig's default, when no window is asked for


def gpt_oss_experts(d: Mapping[str, Any], num_layers: int) -> tuple[MoEConfig, tuple[MlpLayerType, ...]]:
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


def parse_fields(d: Mapping[str, Any], num_layers: int, head_dim: int, max_pos: int) -> Mapping[str, Any]:
    moe, kinds = gpt_oss_experts(d, num_layers)
    return {"moe": moe, "mlp_layer_types": kinds, "attention_sinks": True}


def hf_test_config(model_type: str, config: dict[str, Any], preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """Experts of TEST_EXPERTS; layers alternate (even ones sliding) with W or 128; YaRN."""
    num_layers, max_pos = preset["num_hidden_layers"], preset["max_position_embeddings"]
    config.update({
        "attention_bias": True,
        "head_dim": preset["hidden_size"] // preset["num_attention_heads"],
        "intermediate_size": TEST_EXPERTS["moe_intermediate_size"],
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
        "num_experts_per_tok": TEST_EXPERTS["num_experts_per_tok"],
        "num_local_experts": TEST_EXPERTS["num_experts"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        # YaRN as GPT-OSS ships it, the factor matching max_position_embeddings.
        "rope_parameters": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "original_max_position_embeddings": max_pos // 4,
            "rope_theta": preset["rope_theta"], "rope_type": "yarn", "truncate": False,
        },
        "sliding_window": TEST_SLIDING_WINDOW if sliding_window is None else sliding_window,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    })  # fmt: skip
    return config


CONFIG = ArchConfig(
    architectures=MappingProxyType(
        # Biased q/k/v/o by default, sliding and full layers from layer_types.
        {"GptOssForCausalLM": ArchTraits("gpt_oss", None, None, False, False, "layer_types", 64, True)}
    ),
    test_config=hf_test_config,
    parse=parse_fields,
)
