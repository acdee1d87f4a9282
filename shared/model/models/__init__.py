"""One model file per architecture over the shared layers (nano-vllm's and vLLM's
``models/``), chosen by ``config.json``'s ``architectures`` through ``MODEL_CLASSES``:

- ``llama``: Llama, Qwen2, Qwen3, Mistral (one transformer; differences are data);
- ``qwen3_moe``: Qwen3-MoE;
- ``gpt_oss``: GPT-OSS;
- ``deepseek_v4``: DeepSeek-V4 (compressed attention, mHC; its own KV groups).

Every class is a ``CausalLM`` (the engine's interface: forward over the paged KV
cache, compute_logits, kv_layout, allocate_kv_cache, checkpoint_tensors)."""

from collections.abc import Mapping
from types import MappingProxyType

import torch

from shared.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from shared.model.interface import CausalLM
from shared.model.models.deepseek_v4 import DeepseekV4ForCausalLM
from shared.model.models.gpt_oss import GptOssForCausalLM
from shared.model.models.llama import LlamaForCausalLM
from shared.model.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: Mapping[str, type[CausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "GptOssForCausalLM": GptOssForCausalLM,
        "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    }
)
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "every parsed architecture needs a model class"


def model_class(config: ModelConfig) -> type[CausalLM]:
    return MODEL_CLASSES[config.architecture]


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tie_word_embeddings: bool | None = None,
    kernels: str = "auto",
) -> CausalLM:
    """The model class of ``config.architecture``, built empty in ``dtype`` on ``device``."""
    return model_class(config)(config, dtype, device, tie_word_embeddings, kernels)
