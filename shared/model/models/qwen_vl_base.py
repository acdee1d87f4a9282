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

from collections.abc import Collection

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.layers import MRotaryEmbedding
from shared.model.models.llama import LlamaForCausalLM
from shared.model.multimodal import ImageInputs, InputEmbeddings
from shared.model.parallel import SINGLE, ParallelContext
from shared.model.vision_language_config import VisionLanguageParams


@torch.inference_mode()
def encode_with(visual: nn.Module, images: ImageInputs) -> list[torch.Tensor]:
    """Each image's rows out of a Qwen VL tower (a model's, or a vision instance's tower
    alone: VisionTower in shared/model/tower_loader.py)."""
    merged = visual(images.pixel_values.to(visual.device), images.grids)
    return list(merged.split([visual.num_tokens(g) for g in images.grids]))


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
        self.visual = self.build_tower(config, vl, dtype, torch.device(device))
        self.num_deepstack = self.deepstack_features(vl)
        self.rotary_emb = MRotaryEmbedding(config.rope, config.head_dim, vl.mrope_section, device,
                                           interleaved=vl.mrope_interleaved)  # fmt: skip

    @classmethod
    def build_tower(cls, config: ModelConfig, vl: VisionLanguageParams, dtype: torch.dtype,
                    device: torch.device) -> nn.Module:  # fmt: skip
        """The family's vision transformer (``visual.``), with ``device``, ``num_tokens(grid)``
        and ``forward(pixel_values, grids)`` -> [merged patches, image_embedding_width]. A
        class method: a vision instance builds the tower alone (shared/model/tower_loader.py)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """Our tensor name (``visual.*``, ``model.*``, ``lm_head.*``) as the family's
        released checkpoints spell it: the same by default."""
        return name

    def checkpoint_tensors(self, available: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The Llama family's targets under the family's released names (checkpoint_name):
        what the loader, load_weights(state_dict) and make-model use."""
        return {self.checkpoint_name(name): t for name, t in super().checkpoint_tensors(available).items()}

    def deepstack_features(self, vl: VisionLanguageParams) -> int:
        """Deepstack features per image row (Qwen3-VL's tower); none by default."""
        return 0

    @property
    def image_embedding_width(self) -> int:
        """The columns of an image-pad row's embedding: the input embedding, then one
        deepstack feature per deepstack layer (shared/engine/images.py reads it)."""
        return self.config.hidden_size * (1 + self.num_deepstack)

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
        if tp_size > 1:
            raise ValueError(f"not implemented yet: tensor parallelism for {config.architecture} (its vision tower)")

    def encode_images(self, images: ImageInputs) -> list[torch.Tensor]:
        """Each image's rows [its image-pad tokens, image_embedding_width], in the model
        dtype, on its device (the processor's pixels come from the host)."""
        return encode_with(self.visual, images)

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
