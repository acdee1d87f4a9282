"""Write a small seeded random checkpoint in Hugging Face format: what tests and the
default demo run on, since no weights can be downloaded here.

``config.json`` has exactly the keys and values transformers 5.24's
``save_pretrained`` writes for the architecture (tests check this), so transformers
loads the folder too. Everything is deterministic: the same call twice gives
byte-identical files.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors.torch import save_file

from shared.model.config import ModelConfig
from shared.model.transformer import CausalLM

TRANSFORMERS_VERSION = "5.24.0"  # the version whose save_pretrained output config.json mirrors
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
END_OF_TURN_TOKEN = "<|im_end|>"

PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "tiny": MappingProxyType(
            dict(
                hidden_size=256,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                intermediate_size=688,
                vocab_size=4096,
                max_position_embeddings=4096,
                rope_theta=10000.0,
                tie_word_embeddings=False,
            )
        ),
        # The GPU benchmark's model: Llama-3-8B's shape with seeded random weights.
        "llama3-8b": MappingProxyType(
            dict(
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                vocab_size=128256,
                max_position_embeddings=16384,
                rope_theta=500000.0,
                tie_word_embeddings=False,
            )
        ),
    }
)
ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
)
_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
)


def make_model(
    path: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    preset: str = "tiny",
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    sliding_window: int | None = None,
) -> None:
    """Write config.json, model.safetensors, generation_config.json and (with ``tokenizer``)
    the tokenizer files into ``path``. ``tokenizer=False`` leaves bos/eos ids null.
    ``sliding_window``: see hf_config_dict (the weights do not change with it)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} not supported; choose one of {', '.join(_DTYPE_NAMES.values())}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos, end_of_turn = _write_tokenizer(out, PRESETS[preset]["vocab_size"]) if tokenizer else (None, None, None)

    config = hf_config_dict(arch, PRESETS[preset], _DTYPE_NAMES[dtype], bos, eos, sliding_window)
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": bos, "eos_token_id": [t for t in (eos, end_of_turn) if t is not None] or None}
    _write_json(out / "generation_config.json", {**generation, "transformers_version": TRANSFORMERS_VERSION})
    save_file(_random_weights(ModelConfig.from_dict(config), seed, dtype), str(out / "model.safetensors"), {"format": "pt"})


def hf_config_dict(
    arch: str,
    preset: Mapping[str, Any],
    dtype_name: str,
    bos_token_id: int | None,
    eos_token_id: int | None,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    """config.json as transformers 5.24 writes it for ``arch`` with these dimensions.
    ``sliding_window`` W makes a hybrid model: Qwen2/Qwen3 with every other layer
    (the odd ones) sliding, Mistral with every layer sliding; Llama has none."""
    if sliding_window is not None and arch == "llama":
        raise ValueError("Llama has no sliding-window layers; use qwen2, qwen3 or mistral")
    heads, hidden = preset["num_attention_heads"], preset["hidden_size"]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "dtype": dtype_name,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": preset["intermediate_size"],
        "max_position_embeddings": preset["max_position_embeddings"],
        "model_type": arch,
        "num_attention_heads": heads,
        "num_hidden_layers": preset["num_hidden_layers"],
        "num_key_value_heads": preset["num_key_value_heads"],
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": preset["rope_theta"], "rope_type": "default"},
        "tie_word_embeddings": preset["tie_word_embeddings"],
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": preset["vocab_size"],
    }
    # The per-architecture keys each transformers config class adds.
    if arch in ("llama", "qwen3", "mistral"):
        config["head_dim"] = hidden // heads
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if arch in ("qwen2", "qwen3"):
        num_layers = preset["num_hidden_layers"]
        if sliding_window is None:
            layer_types = ["full_attention"] * num_layers
        else:
            layer_types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(num_layers)]
        config.update(
            layer_types=layer_types,
            max_window_layers=num_layers if sliding_window is None else 0,
            sliding_window=sliding_window,
            use_sliding_window=sliding_window is not None,
        )
    if arch == "mistral":
        config["sliding_window"] = sliding_window
    return config


def _random_weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-style init: normal(0, 0.02) matrices and embeddings, zero biases, unit norms.
    Drawn in float32 in sorted name order from one seeded generator, so the bytes
    depend only on (config, seed, dtype)."""
    # The meta device gives names and shapes without allocating anything.
    shapes = {name: tuple(t.shape) for name, t in CausalLM(config, device="meta").checkpoint_tensors().items()}
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shapes[name])
        elif name.endswith(".bias"):
            tensor = torch.zeros(shapes[name])
        else:
            tensor = torch.empty(shapes[name]).normal_(0.0, 0.02, generator=generator)
        weights[name] = tensor.to(dtype).contiguous()
    return weights


def _write_tokenizer(out: Path, vocab_size: int) -> tuple[int, int, int]:
    """Train the project's tokenizer into ``out``; return the ids of bos, eos and end-of-turn."""
    # Imported here: the Recipe is another package, and only this step needs it.
    from tokenizers import Tokenizer

    from shared.recipe.train_tokenizer import train_tokenizer

    train_tokenizer(out, vocab_size=vocab_size)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, END_OF_TURN_TOKEN)]
    if None in ids:
        raise ValueError(f"tokenizer in {out} lacks one of {BOS_TOKEN}, {EOS_TOKEN}, {END_OF_TURN_TOKEN}")
    return ids[0], ids[1], ids[2]


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
