"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's decoder (the Llama
family's layers, q/k/v biases) with a vision tower under ``visual.``
(shared/model/vision/qwen2_5_vision.py) and the multimodal rotary (M-RoPE:
``MRotaryEmbedding``, positions from shared/model/vision/mrope.py).

A step's images come as ``InputEmbeddings`` (shared/model/multimodal.py): the tower's
outputs (``encode_images``) put in place of the image-pad tokens' embeddings before the
first layer, as transformers' ``masked_scatter`` does. Positions are [3, T] where a
step holds prompt rows of a prompt with images, [T] otherwise (text, decode: every
axis alike), so a decode step is the Llama family's and CUDA graphs capture it as is.

Checkpoint names are the released ones (and transformers 5.24's ``save_pretrained``'s):
``model.*`` and ``lm_head`` for the language model, ``visual.*`` for the tower.
"""

from types import MappingProxyType

import torch

from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.interface import ModelEntry
from shared.model.layers import MRotaryEmbedding
from shared.model.models.llama import LlamaForCausalLM, llama_kv_layout
from shared.model.models.qwen2_5_vl_config import CONFIG
from shared.model.multimodal import ImageInputs, InputEmbeddings
from shared.model.parallel import SINGLE, ParallelContext
from shared.model.vision.qwen2_5_vision import Qwen2_5_VisionTransformer


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
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
        if vl is None:
            raise ValueError(f"{config.architecture} needs vision_language parameters (vision_config, mrope_section)")
        device = torch.device(device)
        self.visual = Qwen2_5_VisionTransformer(vl.vision, dtype, device)
        self.rotary_emb = MRotaryEmbedding(config.rope, config.head_dim, vl.mrope_section, device)

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        if tp_size > 1:
            raise ValueError(f"not implemented yet: tensor parallelism for {config.architecture} (its vision tower)")

    @torch.inference_mode()
    def encode_images(self, images: ImageInputs) -> list[torch.Tensor]:
        """Each image's embeddings [its image-pad tokens, hidden], in the model dtype, on
        its device (the processor's pixels come from the host)."""
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
        step and what goes there (None: no image token in the step)."""
        x = self.model.embed_tokens(input_ids)
        if embeddings is not None:
            x = x.index_copy(0, embeddings.rows, embeddings.embeds.to(x.dtype))
        return self.run_layers(x, input_ids, positions, kv_caches, metas)


ENTRY = ModelEntry(
    config=CONFIG,
    model_classes=MappingProxyType({"Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration}),
    kv_layout=llama_kv_layout,
)
