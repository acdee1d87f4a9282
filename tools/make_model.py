"""Write a seeded random checkpoint in Hugging Face format: what tests, the default
demo (the tiny preset) and the GPU benchmarks (Llama-3-8B's shape) run on, since no
weights can be downloaded here.

``config.json`` has exactly the keys and values transformers 5.24's
``save_pretrained`` writes for the architecture (tests check this), so transformers
loads the folder too. Everything is deterministic: the same call twice gives
byte-identical files.

The tokenizer may be smaller than the model's vocabulary (a padded vocab, as many
real checkpoints have): ids past the tokenizer's are valid model inputs and outputs
that decode to nothing. The stdlib corpus the tokenizer trains on yields about 35k
tokens from its default 4 MB and 80k from all of it, so the llama3-8b preset keeps
the real 128,256-row embedding with a 32,768-token tokenizer.
"""

import json
import math
from collections.abc import Iterator, Mapping
from itertools import islice
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors.torch import save_file

from shared.model.config import ModelConfig
from shared.model.loader import INDEX_FILE, SINGLE_FILE
from shared.model.models import ARCH_CONFIGS, ARCHITECTURE_OF_MODEL_TYPE, TEST_PRESETS, build_model
from tools.chat_formats import FORMATS, apply_chat_format

TRANSFORMERS_VERSION = "5.24.0"  # the version whose save_pretrained output config.json mirrors
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
END_OF_TURN_TOKEN = "<|im_end|>"
# A checkpoint whose tensors take more bytes than this is written as shards of at most
# this size (unless one tensor is larger) with model.safetensors.index.json, as
# transformers' save_pretrained does with max_shard_size="5GB".
MAX_SHARD_BYTES = 5_000_000_000

# Shapes any architecture can be drawn in; a family's own presets (DeepSeek-V4's
# v4-flash-8l) come from its config module through the registry.
_SHAPES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
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
        # The default model's draft (speculative decoding): tiny's vocabulary and
        # tokenizer, half its width and depth (tools/train/default_model.py).
        "tiny-draft": MappingProxyType(
            dict(
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=344,
                vocab_size=4096,
                max_position_embeddings=4096,
                rope_theta=10000.0,
                tie_word_embeddings=False,
            )
        ),
        # A context of 1M tokens and room to answer, in a model small enough that its KV
        # pool for one such request is ~260 MiB (with --sliding-window, as Mistral: every
        # layer sliding); tests/mesh/test_long_prompt.py sends it a 1M-token prompt.
        "tiny-long": MappingProxyType(
            dict(
                hidden_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=128,
                vocab_size=512,
                max_position_embeddings=(1 << 20) + 4096,
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
                # Not config.json keys: the tokenizer is smaller than the embedding (see
                # the module docstring), and 8 MB of stdlib sources yield about 60k tokens,
                # a safe margin over 32,768 on any Python version (the default 4 MB yields
                # 33-36k). Presets without them train vocab_size tokens from 4 MB.
                tokenizer_vocab_size=32768,
                tokenizer_corpus_bytes=8_000_000,
            )
        ),
    }
)
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({**_SHAPES, **TEST_PRESETS})
ARCHITECTURES: Mapping[str, str] = ARCHITECTURE_OF_MODEL_TYPE
"""--arch (the config's model_type) -> HF architecture name, from the model registry."""
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
    device: torch.device | str = "cpu",
    tokenizer_vocab_size: int | None = None,
) -> int:
    """Write config.json, the weights, generation_config.json and (with ``tokenizer``)
    the tokenizer files into ``path``; return the number of parameters. GPT-OSS, Qwen3,
    DeepSeek-V4, Qwen2.5-VL and Qwen3-VL get their chat format's tokens and template
    (chat_formats.py); the VL ones also their image processor's preprocessor_config.json.

    ``tokenizer=False`` leaves bos/eos ids null. ``sliding_window``: see hf_config_dict
    (the weights do not change with it). ``tokenizer_vocab_size``: how many tokens the
    tokenizer is trained to (default: the preset's ``tokenizer_vocab_size``, else its
    ``vocab_size``); at most the model's vocab_size, which config.json keeps.

    The weights are drawn on ``device`` with a generator of that device, one tensor at
    a time, cast to ``dtype`` there and then moved to the CPU, so the host never holds
    the whole model in float32. Their bytes depend on (config, seed, dtype, device): a
    CUDA draw is not byte-equal to a CPU draw, while every CPU draw is the same. Past
    MAX_SHARD_BYTES they are written as shards, each saved (and freed) before the next
    is drawn."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} not supported; choose one of {', '.join(_DTYPE_NAMES.values())}")
    dims = PRESETS[preset]
    if dims.get("arch", arch) != arch:
        raise ValueError(f"preset {preset!r} is {dims['arch']}'s shape: use arch {dims['arch']!r}")
    if tokenizer_vocab_size is None:
        tokenizer_vocab_size = dims.get("tokenizer_vocab_size", dims["vocab_size"])
    if tokenizer_vocab_size > dims["vocab_size"]:
        raise ValueError(
            f"tokenizer_vocab_size={tokenizer_vocab_size} exceeds the model's vocab_size={dims['vocab_size']}"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    chat_format = FORMATS.get(arch)
    stops: list[int] = []
    if tokenizer and chat_format is not None:
        # The family's format tokens come on top of the trained ones (chat_formats.py).
        _write_tokenizer(out, tokenizer_vocab_size - chat_format.num_tokens, dims.get("tokenizer_corpus_bytes"))
        bos, eos, stops = apply_chat_format(out, chat_format)
    elif tokenizer:
        bos, eos, end_of_turn = _write_tokenizer(out, tokenizer_vocab_size, dims.get("tokenizer_corpus_bytes"))
        stops = [eos, end_of_turn]
    else:
        bos, eos = None, None

    if arch in _VISION_PRESETS and tokenizer:
        # config.json names the image tokens by the tokenizer's ids; the image processor's settings beside them.
        dims = {**dims, "token_ids": _vision_token_ids(out)}
        vision = dims.get("vision_language") or PRESETS[_VISION_PRESETS[arch]]["vision_language"]
        _write_json(out / "preprocessor_config.json", _preprocessor_config(vision))
    config = hf_config_dict(arch, dims, _DTYPE_NAMES[dtype], bos, eos, sliding_window)
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": bos, "eos_token_id": stops or None}
    _write_json(out / "generation_config.json", {**generation, "transformers_version": TRANSFORMERS_VERSION})
    return _write_weights(out, ModelConfig.from_dict(config), seed, dtype, torch.device(device))


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
    (the odd ones) sliding, Mistral and Qwen3-MoE with every layer sliding; GPT-OSS
    always alternates (even layers sliding), with W or its default 128; Llama has none
    (each family's ``hf_test_config`` in shared/model/models/<name>_config.py)."""
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
    # The keys each transformers config class adds: the family's config module knows them.
    return ARCH_CONFIGS[ARCHITECTURES[arch]].test_config(arch, config, preset, sliding_window)


def _write_weights(out: Path, config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> int:
    """Draw the weights (see _random_weights) and save them as model.safetensors, or
    past MAX_SHARD_BYTES as model-0000i-of-0000n.safetensors shards with an index;
    return the number of parameters. Checkpoint files of an earlier call are removed
    first, so the loader never reads a stale index or shard."""
    # The meta device gives names and shapes without allocating anything.
    shapes = {name: tuple(t.shape) for name, t in build_model(config, device="meta").checkpoint_tensors().items()}
    names = sorted(shapes)
    numels = {name: math.prod(shapes[name]) for name in names}
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    tensors = _random_weights(shapes, seed, dtype, device, config.moe.num_experts if config.moe else 0)
    shards = _shards(names, {name: numels[name] * dtype.itemsize for name in names})
    if len(shards) == 1:
        save_file(dict(tensors), str(out / SINGLE_FILE), {"format": "pt"})
        return sum(numels.values())
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        # The draw yields in sorted name order, the shards' order; del frees this shard
        # before the next is drawn.
        part = dict(islice(tensors, len(shard)))
        save_file(part, str(out / file), {"format": "pt"})
        del part
        weight_map.update(dict.fromkeys(shard, file))
    total_size = sum(numels.values()) * dtype.itemsize
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    return sum(numels.values())


def _random_weights(
    shapes: Mapping[str, tuple[int, ...]], seed: int, dtype: torch.dtype, device: torch.device, num_experts: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-style init: normal(0, 0.02) matrices and embeddings, zero biases, unit norms.
    Drawn in float32 on ``device`` in sorted name order from one seeded generator of
    that device, cast to ``dtype`` there and yielded one CPU tensor at a time.
    A hash router's ``tid2eid`` [vocab, k] gets k distinct experts per token id (int64)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name in sorted(shapes):
        if name.endswith("tid2eid"):
            scores = torch.rand((shapes[name][0], num_experts), device=device, generator=generator)
            yield name, scores.argsort(dim=-1)[:, : shapes[name][1]].contiguous().cpu()
            continue
        if name.endswith("norm.weight"):
            tensor = torch.ones(shapes[name], device=device)
        elif name.endswith((".bias", "_bias")):
            tensor = torch.zeros(shapes[name], device=device)
        else:
            tensor = torch.empty(shapes[name], device=device).normal_(0.0, 0.02, generator=generator)
        yield name, tensor.to(dtype).contiguous().cpu()


def _shards(names: list[str], nbytes: Mapping[str, int]) -> list[list[str]]:
    """``names`` in order, cut into runs of at most MAX_SHARD_BYTES (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + nbytes[name] > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def _write_tokenizer(out: Path, vocab_size: int, corpus_bytes: int | None) -> tuple[int, int, int]:
    """Train the project's tokenizer into ``out`` (from ``corpus_bytes`` of sources, or
    train_tokenizer's default); return the ids of bos, eos and end-of-turn."""
    # Imported here: the Recipe is another package, and only this step needs it.
    from tokenizers import Tokenizer

    from shared.recipe.train_tokenizer import train_tokenizer

    if corpus_bytes is None:
        train_tokenizer(out, vocab_size=vocab_size)
    else:
        train_tokenizer(out, vocab_size=vocab_size, max_corpus_bytes=corpus_bytes)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, END_OF_TURN_TOKEN)]
    if None in ids:
        raise ValueError(f"tokenizer in {out} lacks one of {BOS_TOKEN}, {EOS_TOKEN}, {END_OF_TURN_TOKEN}")
    return ids[0], ids[1], ids[2]


def _vision_token_ids(out: Path) -> dict[str, int]:
    """The ids of the image tokens (VISION_TOKENS) in the folder's tokenizer."""
    from tokenizers import Tokenizer

    from shared.model.vision_language_config import VISION_TOKENS

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer in {out} lacks {missing}")
    return ids


# The vision-language archs, each with the preset whose tower (and image processor) a
# shape preset of another family gets.
_VISION_PRESETS: Mapping[str, str] = MappingProxyType({"qwen2_5_vl": "tiny-vl", "qwen3_vl": "tiny-qwen3-vl"})


def _preprocessor_config(vision_language: Mapping[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json as Qwen/Qwen2.5-VL ships it (what transformers' processor
    reads), with the preset's pixel bounds; a preset naming its own normalisation and
    processor class (tiny-qwen3-vl: Qwen3-VL's mean and std of 0.5) gets those."""
    tower = vision_language["vision_config"]
    return {
        "image_mean": list(vision_language.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": list(vision_language.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        "max_pixels": vision_language["max_pixels"],
        "merge_size": 2,
        "min_pixels": vision_language["min_pixels"],
        "patch_size": tower["patch_size"],
        "processor_class": vision_language.get("processor_class", "Qwen2_5_VLProcessor"),
        "temporal_patch_size": 2,
    }


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
