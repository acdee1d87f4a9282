"""Qwen3-VL's config (torch-free, beside models/qwen3_vl.py): its language model is
Qwen3's (q/k norm, no biases, an explicit head_dim) read from ``text_config``, its
vision tower (``Qwen3VisionTowerParams``: learned position embeddings resampled to each
image, deepstack mergers) and image tokens (``VisionLanguageParams``, shared with
Qwen2.5-VL), the sections of its interleaved multimodal rotary, and the config.json
make-model writes for it (as transformers 5.24's ``Qwen3VLConfig.save_pretrained``).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from shared.model.arch_config import ArchConfig, ArchTraits
from shared.model.vision_language_config import VisionLanguageParams, mrope_fields, text_view


@dataclass(frozen=True, slots=True)
class Qwen3VisionTowerParams:
    """Qwen3-VL's vision transformer (``vision_config``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    """The patch merger's output: the language model's hidden size."""
    num_position_embeddings: int
    """The learned position table: a square of sqrt(this) per side, bilinearly resampled
    to each image's grid of patches."""
    deepstack_visual_indexes: tuple[int, ...]
    """The blocks whose outputs, merged by their own merger, are added to the hidden
    states after decoder layers 0, 1, ... at the image rows."""
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One row of ``pixel_values``: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


def parse_fields(d: Mapping[str, Any], num_layers: int, head_dim: int, max_pos: int) -> Mapping[str, Any]:
    fields, section = mrope_fields(d, max_pos, head_dim)
    v = d.get("vision_config") or {}
    hidden_act = v.get("hidden_act", "gelu_pytorch_tanh")
    if hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config hidden_act {hidden_act!r} is not supported (only 'gelu_pytorch_tanh')")
    vision_rope = v.get("rope_parameters") or {}
    if vision_rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type {vision_rope['rope_type']!r} is not supported (only 'axial')")
    depth = int(v.get("depth", 27))
    vision = Qwen3VisionTowerParams(
        depth=depth,
        hidden_size=int(v.get("hidden_size", 1152)),
        intermediate_size=int(v.get("intermediate_size", 4304)),
        num_heads=int(v.get("num_heads", 16)),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
    )
    if vision.out_hidden_size != int(d["hidden_size"]):
        raise ValueError(f"vision out_hidden_size {vision.out_hidden_size} != hidden_size {d['hidden_size']}")
    if vision.head_dim % 4:
        raise ValueError(f"vision head_dim {vision.head_dim} must be a multiple of 4 (two axes of rotary pairs)")
    if vision.grid_side**2 != vision.num_position_embeddings:
        raise ValueError(f"vision num_position_embeddings {vision.num_position_embeddings} must be a square")
    if any(not 0 <= i < depth for i in vision.deepstack_visual_indexes):
        raise ValueError(f"deepstack_visual_indexes {vision.deepstack_visual_indexes} must be blocks of 0..{depth - 1}")
    if len(vision.deepstack_visual_indexes) > num_layers:
        raise ValueError(f"{len(vision.deepstack_visual_indexes)} deepstack features for {num_layers} decoder layers")
    params = VisionLanguageParams(
        vision=vision,
        image_token_id=int(d.get("image_token_id", 151655)),
        video_token_id=int(d.get("video_token_id", 151656)),
        vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
        mrope_section=section,
        mrope_interleaved=True,  # transformers' Qwen3-VL always interleaves (mrope_interleaved is informative)
    )
    return {**fields, "vision_language": params}


def hf_test_config(model_type: str, config: dict[str, Any], preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """config.json as transformers 5.24's save_pretrained writes a Qwen3VLConfig: the
    language model's keys in ``text_config``, the tower in ``vision_config``, the image
    token ids at the top level (``preset["token_ids"]``, make-model's tokenizer's)."""
    if sliding_window is not None:
        raise ValueError("Qwen3-VL test models have no sliding-window layers")
    vl = preset.get("vision_language") or _default_vision(preset)
    token_ids = preset.get("token_ids") or {}
    text = {k: config[k] for k in (
        "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
        "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
        "num_key_value_heads", "pad_token_id", "rms_norm_eps", "use_cache", "vocab_size",
    )}  # fmt: skip
    text.update(
        attention_bias=False,
        dtype=config["dtype"],
        head_dim=preset["hidden_size"] // preset["num_attention_heads"],
        model_type="qwen3_vl_text",
        rope_parameters={**config["rope_parameters"], "mrope_interleaved": True,
                         "mrope_section": list(vl["mrope_section"])},  # fmt: skip
    )
    tower = dict(vl["vision_config"])
    return {
        "architectures": config["architectures"],
        "dtype": config["dtype"],
        "image_token_id": token_ids.get("<|image_pad|>", 151655),
        "model_type": model_type,
        "text_config": text,
        "tie_word_embeddings": config["tie_word_embeddings"],
        "transformers_version": config["transformers_version"],
        "video_token_id": token_ids.get("<|video_pad|>", 151656),
        "vision_config": {
            "deepstack_visual_indexes": list(tower["deepstack_visual_indexes"]),
            "depth": tower["depth"],
            "dtype": config["dtype"],
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": tower["hidden_size"],
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": tower["intermediate_size"],
            "model_type": "qwen3_vl_vision",
            "num_heads": tower["num_heads"],
            "num_position_embeddings": tower["num_position_embeddings"],
            "out_hidden_size": config["hidden_size"],
            "patch_size": tower["patch_size"],
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": token_ids.get("<|vision_end|>", 151653),
        "vision_start_token_id": token_ids.get("<|vision_start|>", 151652),
    }


PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # A tiny seeded Qwen3-VL for tests: a 3-layer Qwen3 of width 128 (head_dim 32:
        # interleaved M-RoPE sections 6/5/5 of its 16 rotary pairs, Qwen3-VL's 24/20/20
        # in proportion), a 4-block tower of width 64 on 16 px patches whose position
        # table is 8 x 8, blocks 0 and 2 feeding deepstack features into decoder
        # layers 0 and 1.
        "tiny-qwen3-vl": MappingProxyType(
            dict(
                arch="qwen3_vl",
                hidden_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=256,
                vocab_size=4096,
                max_position_embeddings=4096,
                rope_theta=5000000.0,
                tie_word_embeddings=False,
                vision_language=MappingProxyType(
                    dict(
                        mrope_section=(6, 5, 5),
                        vision_config=MappingProxyType(
                            dict(
                                depth=4, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                                num_position_embeddings=64, deepstack_visual_indexes=(0, 2),
                            )
                        ),
                        # The image processor (preprocessor_config.json): at most 512 x 512
                        # pixels, 256 image tokens; Qwen3-VL's normalisation and processor.
                        min_pixels=4096,
                        max_pixels=262144,
                        image_mean=(0.5, 0.5, 0.5),
                        image_std=(0.5, 0.5, 0.5),
                        processor_class="Qwen3VLProcessor",
                    )
                ),
            )
        ),
    }
)


def _default_vision(preset: Mapping[str, Any]) -> Mapping[str, Any]:
    """A shape preset of any family (tiny...) gets tiny-qwen3-vl's tower, the rotary
    sections in Qwen3-VL's proportions (24/20/20 of 64 pairs)."""
    pairs = preset["hidden_size"] // preset["num_attention_heads"] // 2
    height = pairs * 20 // 64
    return {**PRESETS["tiny-qwen3-vl"]["vision_language"], "mrope_section": (pairs - 2 * height, height, height)}


CONFIG = ArchConfig(
    architectures=MappingProxyType(
        # Qwen3's language model: q/k norm, biases as attention_bias says (none in the
        # released ones), head_dim 128 where config.json lacks it (Qwen3VLTextConfig's).
        {"Qwen3VLForConditionalGeneration": ArchTraits("qwen3_vl", None, None, False, True, "qwen", 128,
                                                        accepts_images=True)}
    ),
    test_config=hf_test_config,
    parse=parse_fields,
    presets=PRESETS,
    view=text_view,
)
