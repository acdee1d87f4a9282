"""What every architecture family's config builds on (torch-free): ``ArchConfig``, what
a family declares about itself (its architectures with their ``ArchTraits``, its own
field parser, its make-model test configs), and the rotary embedding (``RopeConfig``,
``parse_rope``), which ``ModelConfig`` reads for most families and a family's parser
calls for its own ropes (DeepSeek-V4's two).

It imports nothing of the model: ``shared/model/config.py`` (``ModelConfig``) and each
``shared/model/models/<name>_config.py`` import it, and neither imports the other back.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

RopeType = Literal["default", "linear", "llama3", "yarn"]
SlidingRule = Literal["none", "qwen", "all", "all_if_enabled", "layer_types"]


@dataclass(frozen=True, slots=True)
class ArchTraits:
    """What one architecture changes in the shared transformer."""

    model_type: str
    qkv_bias: bool | None  # None: read ``attention_bias`` from the config
    o_bias: bool | None  # None: read ``attention_bias`` from the config
    has_mlp_bias_key: bool  # Llama's ``mlp_bias``; the others have no MLP bias
    qk_norm: bool
    sliding: SlidingRule
    default_head_dim: int | None  # None: hidden_size // num_attention_heads
    attention_bias_default: bool = False  # ``attention_bias`` when config.json lacks it
    trained_for_bounded_replay: bool = False
    """Trained to resume from SWA bounded replay (DeepSeek-V4): the engine's swa_replay
    then defaults to "bounded". Any other model defaults to "exact", since bounded
    replay drifts on a model not trained for it (docs/architecture.md)."""
    accepts_images: bool = False
    """A vision-language model: chat requests may carry image content parts, which the
    balancer loads and passes on (shared/multimodal/). A text-only model's request with
    an image is refused with a 400 naming the part, before any image is fetched."""


FieldParser = Callable[[Mapping[str, Any], int, int, int], Mapping[str, Any]]
"""(config.json, num_hidden_layers, head_dim, max_position_embeddings) -> the
``ModelConfig`` fields a family reads itself; they replace the shared reading of the
same field (``rope``, ``intermediate_size``) or add theirs (``moe``...)."""
HfTestConfig = Callable[[str, dict[str, Any], Mapping[str, Any], "int | None"], dict[str, Any]]
"""(model_type, the keys every architecture's config.json has, a preset's dimensions,
sliding_window) -> config.json as transformers 5.24 writes it for that architecture."""


ConfigView = Callable[[Mapping[str, Any]], Mapping[str, Any]]
"""config.json -> the mapping the shared reader reads (a vision-language model's
``text_config`` brought up beside its top-level keys)."""


def no_fields(d: Mapping[str, Any], num_layers: int, head_dim: int, max_pos: int) -> Mapping[str, Any]:
    """The dense families' parser: every field is the shared reading."""
    return {}


def same_view(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text-only families' view: config.json as it is."""
    return d


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """An architecture family's config: what ``models/<name>_config.py`` exports as ``CONFIG``."""

    architectures: Mapping[str, ArchTraits]
    """HF architecture name (``config.json``'s ``architectures``) -> its traits."""
    test_config: HfTestConfig
    """The family's tiny seeded test configs (make-model; see HfTestConfig)."""
    parse: FieldParser = no_fields
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    """make-model presets only this family can draw (each names its ``arch``)."""
    view: ConfigView = same_view
    """What the shared reader and ``parse`` read: config.json itself, or for a
    vision-language family its language model's keys at the top level."""


LAYER_TYPES = ("full_attention", "sliding_attention")
"""The attention kinds ``config.json``'s ``layer_types`` names (and a per-layer-type
``rope_parameters`` would be keyed by)."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters, as transformers' ``rope_parameters`` after standardisation."""

    rope_type: RopeType = "default"
    rope_theta: float = 10000.0
    factor: float | None = None  # linear and llama3
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    truncate: bool | None = None  # yarn
    attention_factor: float | None = None
    """yarn: the factor cos and sin are multiplied by (resolved as transformers does)."""


def parse_rope(d: Mapping[str, Any], max_position_embeddings: int) -> RopeConfig:
    # transformers: an old ``rope_scaling`` wins over ``rope_parameters``; the
    # top-level ``rope_theta`` fills in a dict that lacks one.
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    if any(key in LAYER_TYPES for key in params):
        raise ValueError("per-layer-type rope_parameters are not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig("default", theta)
    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=float(params["factor"]))
    if rope_type == "llama3":
        # As standardize_rope_params: a top-level value has priority, then the dict's, then max_position_embeddings.
        original = d.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", max_position_embeddings
        )
        return RopeConfig(
            "llama3",
            theta,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    if rope_type == "yarn":
        return _yarn(d, params, theta, max_position_embeddings)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, yarn")


def _yarn(d: Mapping[str, Any], params: Mapping[str, Any], theta: float, max_pos: int) -> RopeConfig:
    """YaRN as transformers' _compute_yarn_parameters reads it: the attention factor
    from ``attention_factor``, else mscale/mscale_all_dim, else 0.1 ln(factor) + 1."""
    original = params.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_type 'yarn' needs original_max_position_embeddings")
    factor = params.get("factor")
    factor = max_pos / int(original) if factor is None else float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    return RopeConfig(
        "yarn",
        theta,
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )
