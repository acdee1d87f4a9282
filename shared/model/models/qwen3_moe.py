"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm) with a
sparse MLP in the layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick: a
softmax router over all experts (``mlp.gate``), top-k, optionally renormalised, and
SiLU-gated experts (``mlp.experts.<e>.gate_proj``... or transformers' fused
``mlp.experts.gate_up_proj``/``down_proj``). The other layers keep a dense MLP."""

from types import MappingProxyType

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.interface import ModelEntry
from shared.model.models.llama import LlamaForCausalLM, dense_mlp, llama_kv_layout
from shared.model.models.qwen3_moe_config import CONFIG
from shared.model.moe import SparseMoE
from shared.model.ops import Ops


def qwen3_moe_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops) -> nn.Module:
    kind = config.mlp_layer_type(layer_idx)
    if kind == "dense" or config.moe is None:
        return dense_mlp(config, layer_idx, dtype, device, ops)
    return SparseMoE(
        config.hidden_size, config.moe, kind, config.vocab_size, dtype, device, router_name="gate", ops=ops
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(qwen3_moe_mlp)


ENTRY = ModelEntry(
    config=CONFIG, model_classes=MappingProxyType({"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}), kv_layout=llama_kv_layout
)
