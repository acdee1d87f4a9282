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
from shared.model.models import build_model

TRANSFORMERS_VERSION = "5.24.0"  # the version whose save_pretrained output config.json mirrors
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
END_OF_TURN_TOKEN = "<|im_end|>"
# A checkpoint whose tensors take more bytes than this is written as shards of at most
# this size (unless one tensor is larger) with model.safetensors.index.json, as
# transformers' save_pretrained does with max_shard_size="5GB".
MAX_SHARD_BYTES = 5_000_000_000
# DeepSeek-V4's layers for a preset of n layers that names none: sliding-only first (as
# V4-Flash's first two), then CSA and HCA (compression 4 and 128, the real rates) in
# turn; the first layer hash-routed. Every kind of layer occurs from 3 layers on.
_V4_CSA, _V4_HCA = "compressed_sparse_attention", "heavily_compressed_attention"

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
        # The V4 GPU benchmark's model (tools/bench/v4_bench.py): DeepSeek-V4-Flash's
        # layout (transformers 5.24's DeepseekV4Config defaults, docs/deepseek_v4_kv.md)
        # scaled to one GPU. Real: hidden 4096, 64 query heads of 512 over one K=V head,
        # partial rotary 64 (1/8), q LoRA 1024, 8 output groups of LoRA 1024, window 128,
        # CSA (compress 4, indexer of 64 heads x 128 keeping 512) and HCA (compress 128),
        # the first two layers sliding only and CSA/HCA in turn after them (CSA first, as
        # tools/bench/v4_kv_bytes.py assumes), the first 3 layers hash-routed, experts of
        # 2048 with top-6 and 1 shared, sqrtsoftplus routing, 4 mHC streams with 20
        # Sinkhorn iterations, vocab 129,280, the compress rope's YaRN factor 16.
        # Scaled: 43 layers -> 8, 256 routed experts -> 64, max_position_embeddings
        # 1,048,576 -> 65,536 (YaRN's original length with it, 65,536 -> 4,096: the
        # engine's default KV pool must hold one request of that length). About 15.0B
        # parameters (30 GB in bfloat16), 3.4B active per token: draw it on a GPU.
        "v4-flash-8l": MappingProxyType(
            dict(
                arch="deepseek_v4",
                hidden_size=4096,
                num_hidden_layers=8,
                num_attention_heads=64,
                num_key_value_heads=1,
                intermediate_size=2048,  # dropped from V4's config.json: moe_intermediate_size below
                vocab_size=129280,
                max_position_embeddings=65536,
                rope_theta=10000.0,
                tie_word_embeddings=False,
                tokenizer_vocab_size=32768,
                tokenizer_corpus_bytes=8_000_000,
                deepseek_v4=MappingProxyType(
                    dict(
                        head_dim=512,
                        partial_rotary_factor=0.125,
                        q_lora_rank=1024,
                        o_groups=8,
                        o_lora_rank=1024,
                        index_n_heads=64,
                        index_head_dim=128,
                        index_topk=512,
                        moe_intermediate_size=2048,
                        n_routed_experts=64,
                        num_experts_per_tok=6,
                        yarn_factor=16.0,
                        layer_types=("sliding_attention",) * 2 + (_V4_CSA, _V4_HCA) * 3,
                        mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 5,
                    )
                ),
            )
        ),
    }
)
ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "gpt_oss": "GptOssForCausalLM",
        "deepseek_v4": "DeepseekV4ForCausalLM",
    }
)
# The MoE families' experts, whatever the preset: small enough to draw fast on the CPU,
# enough experts that routing matters. Qwen3-MoE keeps its last layer dense
# (mlp_only_layers), so a checkpoint has both kinds.
MOE_EXPERTS: Mapping[str, int] = MappingProxyType(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128))
GPT_OSS_SLIDING_WINDOW = 128  # GptOssConfig's default, when no window is asked for
V4_SLIDING_WINDOW = 128  # DeepseekV4Config's default (and the real model's), when no window is asked for
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
    the tokenizer files into ``path``; return the number of parameters.

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
    if tokenizer:
        bos, eos, end_of_turn = _write_tokenizer(out, tokenizer_vocab_size, dims.get("tokenizer_corpus_bytes"))
    else:
        bos, eos, end_of_turn = None, None, None

    config = hf_config_dict(arch, dims, _DTYPE_NAMES[dtype], bos, eos, sliding_window)
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": bos, "eos_token_id": [t for t in (eos, end_of_turn) if t is not None] or None}
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
    always alternates (even layers sliding), with W or its default 128; Llama has none."""
    if sliding_window is not None and arch == "llama":
        raise ValueError("Llama has no sliding-window layers; use qwen2, qwen3, mistral, qwen3_moe or gpt_oss")
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
    if arch == "qwen3_moe":
        config.update(_qwen3_moe_keys(preset, sliding_window))
    if arch == "gpt_oss":
        config.update(_gpt_oss_keys(preset, sliding_window))
    if arch == "deepseek_v4":
        for key in ("intermediate_size", "rope_parameters"):
            del config[key]  # V4 names them moe_intermediate_size and nests its two ropes
        config.update(_deepseek_v4_keys(preset, sliding_window))
    return config


def _deepseek_v4_keys(preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """V4's keys at the preset's width: one K=V head twice as wide as hidden/heads (V4:
    512 for 4096/64... scaled down), a quarter of it rotated, YaRN on the compress rope,
    the real compression rates (4, 128) and indexer top-k over 16 heads, 4 mHC streams,
    the MoE experts of MOE_EXPERTS (every layer sparse, the first hash-routed). A
    preset's ``deepseek_v4`` mapping overrides any of these (v4-flash-8l: the real dims)."""
    v4 = preset.get("deepseek_v4", {})
    num_layers, hidden, max_pos = preset["num_hidden_layers"], preset["hidden_size"], preset["max_position_embeddings"]
    head_dim = v4.get("head_dim", 2 * hidden // preset["num_attention_heads"])
    rotary = v4.get("partial_rotary_factor", 0.25)
    yarn_factor = v4.get("yarn_factor", 4.0)
    default_types = ["sliding_attention"] + [_V4_CSA if i % 2 == 0 else _V4_HCA for i in range(num_layers - 1)]
    layer_types = list(v4.get("layer_types", default_types))
    mlp_layer_types = list(v4.get("mlp_layer_types", ["hash_moe"] + ["moe"] * (num_layers - 1)))
    return {
        "attention_bias": False,
        "compress_rates": {_V4_CSA: 4, _V4_HCA: 128},
        "compress_rope_theta": 160000.0,
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": head_dim,
        "index_head_dim": v4.get("index_head_dim", 32),
        "index_n_heads": v4.get("index_n_heads", 16),
        "index_topk": v4.get("index_topk", 16),
        "layer_types": layer_types[:num_layers],
        "mlp_bias": False,
        "mlp_layer_types": mlp_layer_types[:num_layers],
        "moe_intermediate_size": v4.get("moe_intermediate_size", MOE_EXPERTS["moe_intermediate_size"]),
        "n_routed_experts": v4.get("n_routed_experts", MOE_EXPERTS["num_experts"]),
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": v4.get("num_experts_per_tok", MOE_EXPERTS["num_experts_per_tok"]),
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "o_groups": v4.get("o_groups", 2),
        "o_lora_rank": v4.get("o_lora_rank", hidden // 4),
        "output_router_logits": False,
        "partial_rotary_factor": rotary,
        "q_lora_rank": v4.get("q_lora_rank", hidden // 2),
        "qk_rope_head_dim": int(head_dim * rotary),
        "rope_parameters": {
            "compress": {
                "attention_factor": 1.0, "factor": yarn_factor,
                "original_max_position_embeddings": int(max_pos // yarn_factor),
                "partial_rotary_factor": rotary, "rope_theta": 160000.0, "rope_type": "yarn",
            },
            "main": {"partial_rotary_factor": rotary, "rope_theta": preset["rope_theta"], "rope_type": "default"},
        },
        "rope_theta": preset["rope_theta"],
        "routed_scaling_factor": 1.5,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": V4_SLIDING_WINDOW if sliding_window is None else sliding_window,
        "swiglu_limit": 10.0,
    }  # fmt: skip


def _qwen3_moe_keys(preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [preset["num_hidden_layers"] - 1],
        "moe_intermediate_size": MOE_EXPERTS["moe_intermediate_size"],
        "norm_topk_prob": True,
        "num_experts_per_tok": MOE_EXPERTS["num_experts_per_tok"],
        "num_local_experts": MOE_EXPERTS["num_experts"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
    }


def _gpt_oss_keys(preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    num_layers, max_pos = preset["num_hidden_layers"], preset["max_position_embeddings"]
    return {
        "attention_bias": True,
        "head_dim": preset["hidden_size"] // preset["num_attention_heads"],
        "intermediate_size": MOE_EXPERTS["moe_intermediate_size"],
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
        "num_experts_per_tok": MOE_EXPERTS["num_experts_per_tok"],
        "num_local_experts": MOE_EXPERTS["num_experts"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        # YaRN as GPT-OSS ships it, the factor matching max_position_embeddings.
        "rope_parameters": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "original_max_position_embeddings": max_pos // 4,
            "rope_theta": preset["rope_theta"], "rope_type": "yarn", "truncate": False,
        },
        "sliding_window": GPT_OSS_SLIDING_WINDOW if sliding_window is None else sliding_window,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    }  # fmt: skip


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


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
