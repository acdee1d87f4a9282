"""Qwen2.5-VL's config (torch-free, beside models/qwen2_5_vl.py): its language model is
Qwen2's (q/k/v biases, the Llama family's layers) read from ``text_config`` (v5) or the
top level (v4, as the released checkpoints are), its vision tower and image tokens
(``VisionLanguageParams``, shared/model/vision_language_config.py), the sections of
its multimodal rotary (M-RoPE), and the config.json make-model writes for it.

Both spellings, as transformers 5.24's ``Qwen2_5_VLConfig`` reads them: v5 nests the
language model's keys in ``text_config`` (what ``save_pretrained`` writes); v4 keeps
them at the top level with ``rope_scaling = {"type": "mrope", "mrope_section": ...}``,
whose "mrope" transformers reads as the default rope with sections.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from shared.model.arch_config import ArchConfig, ArchTraits
from shared.model.vision_language_config import VisionLanguageParams, mrope_fields, text_view


@dataclass(frozen=True, slots=True)
class VisionTowerParams:
    """Qwen2.5-VL's vision transformer (``vision_config``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    """The side, in pixels, of the windows the windowed blocks attend within."""
    out_hidden_size: int
    """The patch merger's output: the language model's hidden size."""
    fullatt_block_indexes: tuple[int, ...]
    """The blocks that attend over a whole image; the others within windows."""
    tokens_per_second: int
    """Videos only: temporal M-RoPE positions per second."""
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One row of ``pixel_values``: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


def parse_fields(d: Mapping[str, Any], num_layers: int, head_dim: int, max_pos: int) -> Mapping[str, Any]:
    fields, section = mrope_fields(d, max_pos, head_dim)
    v = d.get("vision_config") or {}
    hidden_act = v.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"vision_config hidden_act {hidden_act!r} is not supported (only 'silu')")
    vision_rope = v.get("rope_parameters") or {}
    if vision_rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type {vision_rope['rope_type']!r} is not supported (only 'axial')")
    depth = int(v.get("depth", 32))
    full = tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
    vision = VisionTowerParams(
        depth=depth,
        hidden_size=int(v.get("hidden_size", 3584)),
        intermediate_size=int(v.get("intermediate_size", 3420)),
        num_heads=int(v.get("num_heads", 16)),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=int(v.get("window_size", 112)),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        fullatt_block_indexes=full,
        tokens_per_second=int(v.get("tokens_per_second", 4)),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
    )
    if vision.out_hidden_size != int(d["hidden_size"]):
        raise ValueError(f"vision out_hidden_size {vision.out_hidden_size} != hidden_size {d['hidden_size']}")
    if vision.head_dim % 4:
        raise ValueError(f"vision head_dim {vision.head_dim} must be a multiple of 4 (two axes of rotary pairs)")
    params = VisionLanguageParams(
        vision=vision,
        image_token_id=int(d.get("image_token_id", 151655)),
        video_token_id=int(d.get("video_token_id", 151656)),
        vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
        mrope_section=section,
    )
    return {**fields, "vision_language": params}


def hf_test_config(model_type: str, config: dict[str, Any], preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """config.json as transformers 5.24's save_pretrained writes a Qwen2_5_VLConfig: the
    language model's keys in ``text_config``, the tower in ``vision_config``, the image
    token ids at the top level (``preset["token_ids"]``, make-model's tokenizer's)."""
    if sliding_window is not None:
        raise ValueError("Qwen2.5-VL test models have no sliding-window layers")
    # A shape preset of any family (tiny...) gets tiny-vl's tower, sections in Qwen2.5-VL's
    # proportions (16/24/24 of 64 pairs); without a tokenizer, the released token ids.
    vl = preset.get("vision_language") or _default_vision(preset)
    token_ids = preset.get("token_ids") or {}
    num_layers = preset["num_hidden_layers"]
    text = {k: config[k] for k in (
        "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
        "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
        "num_key_value_heads", "pad_token_id", "rms_norm_eps", "use_cache", "vocab_size",
    )}  # fmt: skip
    text.update(
        dtype=config["dtype"],
        layer_types=["full_attention"] * num_layers,
        max_window_layers=num_layers,
        model_type="qwen2_5_vl_text",
        rope_parameters={**config["rope_parameters"], "mrope_section": list(vl["mrope_section"])},
        sliding_window=None,
        use_sliding_window=False,
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
            "depth": tower["depth"],
            "dtype": config["dtype"],
            "fullatt_block_indexes": list(tower["fullatt_block_indexes"]),
            "hidden_act": "silu",
            "hidden_size": tower["hidden_size"],
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": tower["intermediate_size"],
            "model_type": "qwen2_5_vl_vision",
            "num_heads": tower["num_heads"],
            "out_hidden_size": config["hidden_size"],
            "patch_size": tower["patch_size"],
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": tower["tokens_per_second"],
            "window_size": tower["window_size"],
        },
        "vision_end_token_id": token_ids.get("<|vision_end|>", 151653),
        "vision_start_token_id": token_ids.get("<|vision_start|>", 151652),
    }


PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # A tiny seeded Qwen2.5-VL for tests: a 3-layer Qwen2 of width 128 (head_dim 32:
        # M-RoPE sections 4/6/6 of its 16 rotary pairs), a 4-block tower of width 64
        # whose windows are 56 px (2x2 merged tokens: a 112 px image has 4 windows),
        # blocks 1 and 3 attending over the whole image.
        "tiny-vl": MappingProxyType(
            dict(
                arch="qwen2_5_vl",
                hidden_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=256,
                vocab_size=4096,
                max_position_embeddings=4096,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                vision_language=MappingProxyType(
                    dict(
                        mrope_section=(4, 6, 6),
                        vision_config=MappingProxyType(
                            dict(
                                depth=4, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=14,
                                window_size=56, fullatt_block_indexes=(1, 3), tokens_per_second=2,
                            )
                        ),
                        # The image processor's bounds (preprocessor_config.json): at most
                        # 448 x 448 pixels, 256 image tokens.
                        min_pixels=3136,
                        max_pixels=200704,
                    )
                ),
            )
        ),
        # The GPU figure's model (tools/bench/vision_goodput.py): Qwen2.5-VL-3B-Instruct's
        # shape with seeded weights (3.75B parameters, 7.5 GB in bfloat16; make-model
        # --device cuda draws it in seconds). head_dim 128: sections 16/24/24 of its 64
        # rotary pairs, as released. The real 151,936-row embedding with a 32,768-token
        # tokenizer, as llama3-8b (tools/make_model.py's docstring says why).
        "qwen2.5-vl-3b": MappingProxyType(
            dict(
                arch="qwen2_5_vl",
                hidden_size=2048,
                num_hidden_layers=36,
                num_attention_heads=16,
                num_key_value_heads=2,
                intermediate_size=11008,
                vocab_size=151936,
                max_position_embeddings=128000,
                rope_theta=1000000.0,
                tie_word_embeddings=True,
                tokenizer_vocab_size=32768,
                tokenizer_corpus_bytes=8_000_000,
                vision_language=MappingProxyType(
                    dict(
                        mrope_section=(16, 24, 24),
                        vision_config=MappingProxyType(
                            dict(
                                depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                                window_size=112, fullatt_block_indexes=(7, 15, 23, 31), tokens_per_second=2,
                            )
                        ),
                        # The released preprocessor_config.json's bounds.
                        min_pixels=3136,
                        max_pixels=12845056,
                    )
                ),
            )
        ),
    }
)


def _default_vision(preset: Mapping[str, Any]) -> Mapping[str, Any]:
    pairs = preset["hidden_size"] // preset["num_attention_heads"] // 2
    temporal = pairs // 4
    height = (pairs - temporal) // 2
    return {**PRESETS["tiny-vl"]["vision_language"], "mrope_section": (temporal, height, pairs - temporal - height)}


CONFIG = ArchConfig(
    architectures=MappingProxyType(
        # Qwen2's language model: q/k/v biases, an unbiased o_proj, no q/k norm.
        {"Qwen2_5_VLForConditionalGeneration": ArchTraits("qwen2_5_vl", True, False, False, False, "qwen", None,
                                                           accepts_images=True)}
    ),
    test_config=hf_test_config,
    parse=parse_fields,
    presets=PRESETS,
    view=text_view,
)
