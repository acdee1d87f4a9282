"""The model's shape and math, parsed from a Hugging Face ``config.json``: the fields
every architecture shares (``ModelConfig``) and the readers they share (sliding windows,
token ids); torch-free (the balancer reads configs without torch).

What a family declares about its config (``ArchConfig``, ``ArchTraits``) and the rotary
reader (``RopeConfig``, ``parse_rope``) are in ``shared/model/arch_config.py``, below
this module and below each family's own reading, which lives beside its model in
``shared/model/models/<name>_config.py`` and exports an ``ArchConfig``: the
architectures it serves with their traits (which projections carry biases, per-head
q/k norms, how the sliding window is read, the default head size), the fields it
parses itself (experts, DeepSeek-V4's parameters and ropes) and the tiny config.json
make-model writes for it. The registry (shared/model/models) collects them. Both config
spellings are accepted: transformers v4 (``rope_theta`` and ``rope_scaling`` at the top
level) and v5 (one ``rope_parameters`` dict, which is what transformers 5.24's
``save_pretrained`` writes, besides ``dtype`` instead of ``torch_dtype`` and, for
Qwen2/Qwen3, ``layer_types``).
"""

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shared.model.arch_config import LAYER_TYPES, ArchConfig, RopeConfig, SlidingRule, parse_rope
from shared.model.moe_config import MlpLayerType, MoEConfig

if TYPE_CHECKING:  # torch only where a dtype is asked for: the balancer reads configs without it
    import torch

    from shared.model.models.deepseek_v4_config import DeepseekV4Params
    from shared.model.vision_language_config import VisionLanguageParams



@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: the window W (a query at p sees keys j with p - j < W), or None for full attention."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """config.json's eos ids, then generation_config.json's (from_pretrained), without repeats."""
    pad_token_id: int | None
    dtype: str | None
    """The checkpoint's dtype name ("bfloat16"), from ``dtype`` (v5) or ``torch_dtype`` (v4)."""
    # Fields added with the MoE families; their defaults are the dense models' values and
    # are left out of the fingerprint, so a dense model's fingerprint did not change.
    moe: MoEConfig | None = None
    """The routed experts of the sparse layers; None: a dense model."""
    mlp_layer_types: tuple[MlpLayerType, ...] = ()
    """Per layer: "dense" (an MLP), "moe" (routed experts), "hash_moe" (experts chosen by
    token id); empty: every layer dense."""
    attention_sinks: bool = False
    """A learned per-head logit that joins every softmax and takes weight (GPT-OSS)."""
    deepseek_v4: "DeepseekV4Params | None" = None
    """DeepSeek-V4's compressed attention, indexer and hyper-connections; None: not V4."""
    compress_rope: RopeConfig | None = None
    """DeepSeek-V4: the rotary of compressed layers, their compressors and indexer
    (``rope`` is then the "main" one, of sliding-only layers); both rotate only
    ``deepseek_v4.rope_head_dim`` channels."""
    vision_language: "VisionLanguageParams | None" = None
    """A vision-language model's vision tower, image tokens and multimodal rotary
    (M-RoPE) sections; None: a text-only model."""

    def mlp_layer_type(self, layer_idx: int) -> MlpLayerType:
        return self.mlp_layer_types[layer_idx] if self.mlp_layer_types else "dense"

    @property
    def torch_dtype(self) -> "torch.dtype | None":
        if self.dtype is None:
            return None
        import torch

        value = getattr(torch, self.dtype, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"config dtype {self.dtype!r} is not a torch dtype")
        return value

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of every parsed field: the same math gives the same
        fingerprint whichever config spelling or transformers version wrote the file."""
        fields = dataclasses.asdict(self)
        for name, default in _ADDED_DEFAULTS.items():
            if fields[name] == default:
                del fields[name]
        for name in _ADDED_ROPE_FIELDS:
            if fields["rope"][name] is None:
                del fields["rope"][name]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        folder = Path(path)
        config = json.loads((folder / "config.json").read_text())
        generation_path = folder / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> "ModelConfig":
        # The registry imports this module (its families' configs build on it): looked up here.
        from shared.model.models import ARCH_CONFIGS, ARCHITECTURE_OF_MODEL_TYPE

        architecture = _architecture(d, ARCH_CONFIGS, ARCHITECTURE_OF_MODEL_TYPE)
        family = ARCH_CONFIGS[architecture]
        traits = family.architectures[architecture]
        d = family.view(d)
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        num_heads = int(d["num_attention_heads"])
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or traits.default_head_dim or hidden // num_heads
        max_pos = int(d.get("max_position_embeddings", 2048))
        attention_bias = bool(d.get("attention_bias", traits.attention_bias_default))
        layers = int(d["num_hidden_layers"])
        own = dict(family.parse(d, layers, int(head_dim), max_pos))
        eos = _token_ids(d.get("eos_token_id"))
        if generation_config is not None:
            eos += tuple(t for t in _token_ids(generation_config.get("eos_token_id")) if t not in eos)
        if "intermediate_size" not in own:
            own["intermediate_size"] = int(d["intermediate_size"])
        if "rope" not in own:
            own["rope"] = parse_rope(d, max_pos)
        return cls(
            architecture=architecture,
            model_type=traits.model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            qkv_bias=attention_bias if traits.qkv_bias is None else traits.qkv_bias,
            o_bias=attention_bias if traits.o_bias is None else traits.o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if traits.has_mlp_bias_key else False,
            qk_norm=traits.qk_norm,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(d, traits.sliding, layers),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=d.get("pad_token_id"),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            **own,
        )


# The fields added with the MoE families and their dense defaults (see fingerprint).
_ADDED_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"moe": None, "mlp_layer_types": (), "attention_sinks": False, "deepseek_v4": None, "compress_rope": None,
     "vision_language": None}
)
_ADDED_ROPE_FIELDS = ("beta_fast", "beta_slow", "truncate", "attention_factor")


def _architecture(d: Mapping[str, Any], supported: Mapping[str, ArchConfig], by_model_type: Mapping[str, str]) -> str:
    architectures = d.get("architectures") or []
    if not architectures and d.get("model_type") in by_model_type:
        return by_model_type[d["model_type"]]
    for name in architectures:
        if name in supported:
            return name
    shown = ", ".join(architectures) or f"model_type={d.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {shown}; supported: {', '.join(supported)}")


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _sliding_windows(d: Mapping[str, Any], rule: SlidingRule, num_layers: int) -> tuple[int | None, ...]:
    if rule == "none":
        return (None,) * num_layers
    window = d.get("sliding_window")
    if rule == "all_if_enabled":
        # Qwen3-MoE: the window (only with use_sliding_window) applies to every layer.
        enabled = d.get("use_sliding_window", False) and window is not None
        return (int(window) if enabled else None,) * num_layers
    if rule == "layer_types":
        # GPT-OSS: layer_types, by default even layers sliding and odd ones full.
        layer_types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        ]
        if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ValueError(f"layer_types must be {num_layers} of {LAYER_TYPES}, got {layer_types}")
        if window is None and "sliding_attention" in layer_types:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if rule == "all":
        # Mistral: one window for every layer when set; layer_types is ignored by MistralForCausalLM.
        return (None if window is None else int(window),) * num_layers
    # Qwen2/Qwen3: the window exists only with use_sliding_window; which layers use it comes from
    # layer_types when written (v5 always writes it), else layers i >= max_window_layers.
    if not d.get("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    layer_types = d.get("layer_types")
    if layer_types is None:
        first_sliding = int(d.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must be {num_layers} of {LAYER_TYPES}, got {layer_types}")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
