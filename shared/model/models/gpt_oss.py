"""GPT-OSS (``GptOssForCausalLM``): attention with q/k/v/o biases and a learned sink
logit per head (``self_attn.sinks``), sliding-window and full layers alternating
(``layer_types``), YaRN rope; every MLP sparse: a biased router (``mlp.router``)
whose top-k logits are softmaxed, and experts with biases and the clamped
``(up + 1) * gate * sigmoid(alpha * gate)`` activation, stored fused
(``mlp.experts.gate_up_proj`` [E, hidden, 2I], gate and up interleaved).

The attention sinks and the rope are data the shared attention reads
(``ModelConfig.attention_sinks``, ``RopeConfig``); what this file adds is the MLP.
Checkpoints as OpenAI releases them, with the experts in MXFP4 (``gate_up_proj_blocks``
/ ``_scales``, ``quant_method: mxfp4``), load: the loader dequantises them on the CPU
into ``gate_up_proj`` / ``down_proj`` in the model's dtype (shared/model/checkpoint_files.py),
or, with ``quantized_weights = "keep"`` on CUDA, keeps them packed for the MXFP4 fused MoE
(shared/model/kept_weights.py, kernels/fused_moe_mxfp4.py)."""

from types import MappingProxyType

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.interface import ModelEntry
from shared.model.models.gpt_oss_config import CONFIG
from shared.model.models.llama import LlamaForCausalLM, llama_kv_layout
from shared.model.moe import SparseMoE
from shared.model.ops import Ops


def gpt_oss_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops) -> nn.Module:
    if config.moe is None:
        raise ValueError("a GPT-OSS config without experts")
    kind = config.mlp_layer_type(layer_idx)
    return SparseMoE(
        config.hidden_size, config.moe, kind, config.vocab_size, dtype, device, router_name="router", ops=ops
    )


class GptOssForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(gpt_oss_mlp)
    # GptOssRMSNorm scales in float32 and casts once (bf16 logits drift otherwise).
    norm_scale_in_float32 = True


ENTRY = ModelEntry(
    config=CONFIG, model_classes=MappingProxyType({"GptOssForCausalLM": GptOssForCausalLM}), kv_layout=llama_kv_layout
)
