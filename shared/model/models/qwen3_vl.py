"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's decoder (the Llama family's
layers, q/k norm) with a vision tower under ``visual.``
(shared/model/vision/qwen3_vision.py), the interleaved multimodal rotary
(``MRotaryEmbedding(interleaved=True)``, positions from shared/model/vision/mrope.py,
the same as Qwen2.5-VL's), and deepstack: features of early tower blocks added to the
hidden states after the first decoder layers at the image rows.

The engine's image path is Qwen2.5-VL's unchanged: ``encode_images`` gives each image
one row per image-pad token, here the merger's output and the deepstack features side
by side ([tokens, hidden x (1 + deepstack)], ``image_embedding_width``), so the rows the
engine cuts per step (chunked prefill) carry their deepstack features with them; the
forward splits the columns again.

Checkpoint names: transformers 5.24 saves (and the released checkpoints hold)
``model.language_model.*``, ``model.visual.*`` and ``lm_head``; ``checkpoint_tensors``
names our modules (``model.*``, ``visual.*``) so.
"""

from types import MappingProxyType

import torch

from shared.model.config import ModelConfig
from shared.model.interface import ModelEntry
from shared.model.models.llama import llama_kv_layout
from shared.model.models.qwen3_vl_config import CONFIG, Qwen3VisionTowerParams
from shared.model.models.qwen_vl_base import QwenVLForConditionalGeneration
from shared.model.vision.qwen3_vision import Qwen3VisionTransformer
from shared.model.vision_language_config import VisionLanguageParams

# Our module prefixes -> the released (and save_pretrained's) ones.
_RELEASED_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def _released_name(name: str) -> str:
    for ours, released in _RELEASED_PREFIXES:
        if name.startswith(ours):
            return released + name[len(ours) :]
    return name  # lm_head.*


class Qwen3VLForConditionalGeneration(QwenVLForConditionalGeneration):
    """The image path, the M-RoPE (interleaved: the config says so) and the checks are
    the base's (qwen_vl_base.py); the tower is Qwen3-VL's, its rows wider by the
    deepstack features, and the checkpoint names are the released ones."""

    @classmethod
    def build_tower(cls, config: ModelConfig, vl: VisionLanguageParams, dtype: torch.dtype,
                    device: torch.device) -> Qwen3VisionTransformer:  # fmt: skip
        if not isinstance(vl.vision, Qwen3VisionTowerParams):
            raise ValueError(f"{config.architecture} needs Qwen3-VL vision_language parameters (vision_config)")
        return Qwen3VisionTransformer(vl.vision, dtype, device)

    def deepstack_features(self, vl: VisionLanguageParams) -> int:
        """One feature per ``deepstack_visual_indexes`` block of the tower."""
        assert isinstance(vl.vision, Qwen3VisionTowerParams)  # build_tower checked it
        return len(vl.vision.deepstack_visual_indexes)

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """The released names (transformers 5.24 saves these too)."""
        return _released_name(name)


ENTRY = ModelEntry(
    config=CONFIG,
    model_classes=MappingProxyType({"Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration}),
    kv_layout=llama_kv_layout,
)
