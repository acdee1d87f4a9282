"""The Llama family's config (torch-free, beside models/llama.py): Llama, Qwen2, Qwen3
and Mistral are one transformer, told apart by their traits (``CONFIG.architectures``),
and by the keys transformers 5.24 writes into their config.json (``hf_test_config``)."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from shared.model.arch_config import ArchConfig, ArchTraits


def hf_test_config(model_type: str, config: dict[str, Any], preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """The keys each transformers config class adds. ``sliding_window`` W makes a hybrid
    model: Qwen2/Qwen3 with every other layer (the odd ones) sliding, Mistral with every
    layer sliding; Llama has none."""
    if sliding_window is not None and model_type == "llama":
        raise ValueError("Llama has no sliding-window layers; use qwen2, qwen3, mistral, qwen3_moe or gpt_oss")
    heads, hidden = preset["num_attention_heads"], preset["hidden_size"]
    if model_type in ("llama", "qwen3", "mistral"):
        config["head_dim"] = hidden // heads
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = False
    if model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if model_type in ("qwen2", "qwen3"):
        num_layers = preset["num_hidden_layers"]
        if sliding_window is None:
            layer_types = ["full_attention"] * num_layers
        else:
            layer_types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(num_layers)]
        config.update(
            layer_types=layer_types,
            max_window_layers=num_layers if sliding_window is None else 0,
            sliding_window=sliding_window,
            use_sliding_window=sliding_window is not None,
        )
    if model_type == "mistral":
        config["sliding_window"] = sliding_window
    return config


CONFIG = ArchConfig(
    architectures=MappingProxyType(
        {
            "LlamaForCausalLM": ArchTraits("llama", None, None, True, False, "none", None),
            # Qwen2 hard-codes q/k/v biases and an unbiased o_proj (modeling_qwen2.py).
            "Qwen2ForCausalLM": ArchTraits("qwen2", True, False, False, False, "qwen", None),
            # Qwen3Config's head_dim defaults to 128, not hidden/heads.
            "Qwen3ForCausalLM": ArchTraits("qwen3", None, None, False, True, "qwen", 128),
            "MistralForCausalLM": ArchTraits("mistral", False, False, False, False, "all", None),
        }
    ),
    test_config=hf_test_config,
)
