"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's decoder (the Llama
family's layers, q/k/v biases) with a vision tower under ``visual.``
(shared/model/vision/qwen2_5_vision.py) and the multimodal rotary (M-RoPE:
``MRotaryEmbedding``, positions from shared/model/vision/mrope.py).

A step's images come as ``InputEmbeddings`` (shared/model/multimodal.py): the tower's
outputs (``encode_images``) put in place of the image-pad tokens' embeddings before the
first layer, as transformers' ``masked_scatter`` does (both in the base the Qwen VL
families share, qwen_vl_base.py). Positions are [3, T] where a
step holds prompt rows of a prompt with images, [T] otherwise (text, decode: every
axis alike), so a decode step is the Llama family's and CUDA graphs capture it as is.

Checkpoint names are the released ones (and transformers 5.24's ``save_pretrained``'s):
``model.*`` and ``lm_head`` for the language model, ``visual.*`` for the tower.
"""

from types import MappingProxyType

import torch

from shared.model.config import ModelConfig
from shared.model.interface import ModelEntry
from shared.model.models.llama import llama_kv_layout
from shared.model.models.qwen2_5_vl_config import CONFIG, VisionTowerParams
from shared.model.models.qwen_vl_base import QwenVLForConditionalGeneration
from shared.model.vision.qwen2_5_vision import Qwen2_5_VisionTransformer
from shared.model.vision_language_config import VisionLanguageParams


class Qwen2_5_VLForConditionalGeneration(QwenVLForConditionalGeneration):
    """The image path, the M-RoPE and the checks are the base's (qwen_vl_base.py); the
    tower is Qwen2.5-VL's (windowed attention, no deepstack)."""

    @classmethod
    def build_tower(cls, config: ModelConfig, vl: VisionLanguageParams, dtype: torch.dtype,
                    device: torch.device) -> Qwen2_5_VisionTransformer:  # fmt: skip
        if not isinstance(vl.vision, VisionTowerParams):
            raise ValueError(f"{config.architecture} needs Qwen2.5-VL vision_language parameters (vision_config)")
        return Qwen2_5_VisionTransformer(vl.vision, dtype, device)


ENTRY = ModelEntry(
    config=CONFIG,
    model_classes=MappingProxyType({"Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration}),
    kv_layout=llama_kv_layout,
)
