"""What the vision-language families' configs share (torch-free, below them as
moe_config.py is below the MoE families): ``VisionLanguageParams`` (the image tokens,
the tower, the M-RoPE sections, held in ``ModelConfig.vision_language``), the reading
of the multimodal rotary's sections, the view that brings ``text_config`` up, and the
image tokens make-model's tokenizer gets. Qwen2.5-VL (models/qwen2_5_vl_config.py) and
Qwen3-VL (models/qwen3_vl_config.py) build on it."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shared.model.arch_config import parse_rope

# The image tokens make-model's tokenizer gets (tools/chat_formats.py): the names the
# released tokenizers have. hf_test_config reads their ids from the preset's arguments.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


class VisionTower(Protocol):
    """What the engine reads of a family's tower parameters (each family's dataclass)."""

    @property
    def spatial_merge_size(self) -> int: ...

    @property
    def out_hidden_size(self) -> int: ...

    @property
    def patch_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class VisionLanguageParams:
    """What a vision-language model adds to its language model's config (Qwen2.5-VL's,
    Qwen3-VL's: the same image tokens and M-RoPE, each family its own tower)."""

    vision: VisionTower
    image_token_id: int
    """The placeholder the processor repeats once per merged patch of an image."""
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]
    """Rotary channel pairs (head_dim / 2 in all) turned by the temporal, height and
    width positions, in that order (contiguous sections, Qwen2-VL's layout)."""
    mrope_interleaved: bool = False
    """Qwen3-VL's layout: pair i is the height's where i % 3 == 1 (below 3 x sections[1]),
    the width's where i % 3 == 2 (below 3 x sections[2]), the temporal's otherwise."""


def text_view(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """config.json with ``text_config``'s keys at the top level, the top level's own
    winning where transformers reads them there (architectures, model_type, dtype,
    the token ids of images), tied embeddings set when either level sets them (as
    Qwen2_5_VLConfig's backward compatibility does)."""
    text = d.get("text_config")
    if not text:
        return d
    merged = {**d, **{k: v for k, v in text.items() if k not in ("model_type", "dtype", "torch_dtype")}}
    merged["tie_word_embeddings"] = bool(d.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))
    return merged


def mrope_fields(d: Mapping[str, Any], max_pos: int, head_dim: int) -> tuple[Mapping[str, Any], tuple[int, int, int]]:
    """(the ``rope`` field, the M-RoPE sections) of a text view: the rope parameters
    without their sections (and Qwen3-VL's ``mrope_interleaved``, which transformers
    does not read: its family always interleaves)."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    section = params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    if params.get("rope_type", params.get("type")) == "mrope":  # v4's name for the default rope with sections
        params.pop("type", None)
        params["rope_type"] = "default"
    if section is None or len(section) != 3:
        raise ValueError(f"a multimodal rotary needs rope mrope_section of three ints, got {section!r}")
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
    rope = parse_rope({**d, "rope_scaling": None, "rope_parameters": params}, max_pos)
    return {"rope": rope}, (int(section[0]), int(section[1]), int(section[2]))
