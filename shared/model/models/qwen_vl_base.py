"""What the Qwen vision-language families (Qwen2.5-VL, qwen2_5_vl.py; Qwen3-VL,
qwen3_vl.py) share as models: a Llama-family decoder with a vision tower under
``visual.``, the multimodal rotary (M-RoPE) in place of the plain one, the image path
the engine drives (``encode_images``, then a forward that puts the rows in place of the
image-pad tokens' embeddings), and no tensor parallelism yet. The families differ in
their tower (each builds its own: ``build_tower``), the rotary's layout (data:
``VisionLanguageParams.mrope_interleaved``), and Qwen3-VL's deepstack features, which
ride in the same rows as extra columns (``deepstack_features``; zero for Qwen2.5-VL, whose
forward is then transformers' ``masked_scatter`` alone).

Not a family of its own (no ``ENTRY``, not in ``FAMILIES``): a base the two model
files subclass, so a fix to the image path is made once."""

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.layers import MRotaryEmbedding
from shared.model.models.llama import LlamaForCausalLM
from shared.model.multimodal import ImageInputs, InputEmbeddings
from shared.model.parallel import SINGLE, ParallelContext
from shared.model.vision_language_config import VisionLanguageParams


class QwenVLForConditionalGeneration(LlamaForCausalLM):
    """A Qwen VL model: subclasses give ``build_tower`` (and ``num_deepstack`` where
    their tower's rows carry deepstack features)."""

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
        self.visual = self.build_tower(vl, dtype, device)
        self.num_deepstack = self.deepstack_features(vl)
        self.rotary_emb = MRotaryEmbedding(config.rope, config.head_dim, vl.mrope_section, device,
                                           interleaved=vl.mrope_interleaved)  # fmt: skip

    def build_tower(self, vl: VisionLanguageParams, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The family's vision transformer (``visual.``), with ``device``, ``num_tokens(grid)``
        and ``forward(pixel_values, grids)`` -> [merged patches, image_embedding_width]."""
        raise NotImplementedError

    def deepstack_features(self, vl: VisionLanguageParams) -> int:
        """Deepstack features per image row (Qwen3-VL's tower); none by default."""
        return 0

    @property
    def image_embedding_width(self) -> int:
        """The columns of an image-pad row's embedding: the input embedding, then one
        deepstack feature per deepstack layer (shared/engine/images.py reads it)."""
        return self.config.hidden_size * (1 + self.num_deepstack)

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
            width = embeddings.embeds.shape[-1]
            if width != self.image_embedding_width:
                raise ValueError(f"image rows of {width} columns, {self.config.architecture} takes "
                                 f"{self.image_embedding_width}")  # fmt: skip
            # The input embedding, then the deepstack features (added after the first layers).
            columns = embeddings.embeds.split(self.config.hidden_size, dim=-1)
            x = x.index_copy(0, embeddings.rows, columns[0].to(x.dtype))
            added = [InputEmbeddings(embeddings.rows, feature) for feature in columns[1:]]
        return self.run_layers(x, input_ids, positions, kv_caches, metas, added)
