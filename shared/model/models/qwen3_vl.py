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

from collections.abc import Collection
from types import MappingProxyType

import torch

from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.interface import ModelEntry
from shared.model.layers import MRotaryEmbedding
from shared.model.models.llama import LlamaForCausalLM, llama_kv_layout
from shared.model.models.qwen3_vl_config import CONFIG, Qwen3VisionTowerParams
from shared.model.multimodal import ImageInputs, InputEmbeddings
from shared.model.parallel import SINGLE, ParallelContext
from shared.model.vision.qwen3_vision import Qwen3VisionTransformer

# Our module prefixes -> the released (and save_pretrained's) ones.
_RELEASED_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def _released_name(name: str) -> str:
    for ours, released in _RELEASED_PREFIXES:
        if name.startswith(ours):
            return released + name[len(ours) :]
    return name  # lm_head.*


class Qwen3VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tie_word_embeddings: bool | None = None,
        kernels: str = "auto",
        *,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__(config, dtype, device, tie_word_embeddings, kernels, parallel=parallel)
        vl = config.vision_language
        if vl is None or not isinstance(vl.vision, Qwen3VisionTowerParams):
            raise ValueError(f"{config.architecture} needs Qwen3-VL vision_language parameters (vision_config)")
        device = torch.device(device)
        self.visual = Qwen3VisionTransformer(vl.vision, dtype, device)
        self.rotary_emb = MRotaryEmbedding(config.rope, config.head_dim, vl.mrope_section, device, interleaved=True)
        self.num_deepstack = len(vl.vision.deepstack_visual_indexes)

    @property
    def image_embedding_width(self) -> int:
        """The columns of an image-pad row's embedding: the input embedding, then one
        deepstack feature per deepstack layer."""
        return self.config.hidden_size * (1 + self.num_deepstack)

    def checkpoint_tensors(self, available: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The Llama family's targets under the released names (transformers 5.24 saves
        these too): what the loader, load_weights(state_dict) and make-model use."""
        return {_released_name(name): t for name, t in super().checkpoint_tensors(available).items()}

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        if tp_size > 1:
            raise ValueError(f"not implemented yet: tensor parallelism for {config.architecture} (its vision tower)")

    @torch.inference_mode()
    def encode_images(self, images: ImageInputs) -> list[torch.Tensor]:
        """Each image's rows [its image-pad tokens, image_embedding_width], in the model
        dtype, on its device (the processor's pixels come from the host)."""
        merged = self.visual(images.pixel_values.to(self.visual.device), images.grids)
        return list(merged.split([self.visual.num_tokens(g) for g in images.grids]))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metas: list[AttentionMetadata],
        embeddings: InputEmbeddings | None = None,
    ) -> torch.Tensor:
        """``positions`` [T] or [3, T] (M-RoPE); ``embeddings``: the image rows of this
        step and their ``encode_images`` rows (None: no image token in the step)."""
        x = self.model.embed_tokens(input_ids)
        added: list[InputEmbeddings] = []
        if embeddings is not None:
            columns = embeddings.embeds.split(self.config.hidden_size, dim=-1)
            x = x.index_copy(0, embeddings.rows, columns[0].to(x.dtype))
            added = [InputEmbeddings(embeddings.rows, feature) for feature in columns[1:]]
        return self.run_layers(x, input_ids, positions, kv_caches, metas, added)


ENTRY = ModelEntry(
    config=CONFIG,
    model_classes=MappingProxyType({"Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration}),
    kv_layout=llama_kv_layout,
)
