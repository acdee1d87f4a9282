"""Tiny seeded transformers models saved in HF format: the reference our model is checked
against. Every parameter (biases and norm weights included) is re-drawn at random, so
a bias or norm we forgot to apply shows up as a logit mismatch."""

from pathlib import Path
from typing import Any

import torch

# Small dims that still exercise everything: several heads per kv head, several layers.
_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# Each entry: the transformers config class name and what the variant exercises.
ARCH_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama-3 rope scaling with a short original context, so all three frequency bands occur
    # (head_dim 16, theta 5e5: wavelengths 6.3 < 16, 16 < 32.6 < 64, 169 > 64).
    "llama3_rope": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    # Plain multi-head attention, Llama's attention_bias (o_proj too) and mlp_bias.
    "llama_mha_bias": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    # q/k/v biases, tied embeddings, hybrid layers: layer 0 full, layers 1-2 sliding.
    "qwen2": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    # q/k norm, head_dim 24 != 64 / 4, MQA.
    "qwen3_mqa": ("Qwen3Config", dict(head_dim=24, num_key_value_heads=1)),
    # Sliding window 8 in every layer, GQA 4:2.
    "mistral": ("MistralConfig", dict(sliding_window=8)),
}


# The MoE families (tests/test_moe_parity.py): several sparse/dense layer mixes, windows.
MOE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers), renormalised top-2 of 8.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    # Only layer 1 sparse (decoder_sparse_step 2), top-3 not renormalised, a window on every layer.
    "qwen3_moe_step2": (
        "Qwen3MoeConfig",
        dict(
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, decoder_sparse_step=2,
            use_sliding_window=True, sliding_window=6, head_dim=24,
        ),
    ),
    # Sliding (0, 2) and full (1) layers, sinks, YaRN with a short original context so the
    # ramp bites, a swiglu limit low enough that the clamp bites.
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=6,
            swiglu_limit=0.3, max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                original_max_position_embeddings=32, truncate=False,
            ),
        ),
    ),
}


def save_tiny_hf_model(arch: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build the tiny transformers model ``arch`` (a key of ARCH_VARIANTS or one of
    llama/qwen2/qwen3/mistral), randomise it with ``seed`` and ``save_pretrained`` it into
    ``path``. ``overrides`` go to the config, except ``max_shard_size`` which goes to
    ``save_pretrained``. Returns ``path``."""
    import transformers

    aliases = {"llama": "llama3_rope", "qwen3": "qwen3_mqa"}
    class_name, variant = {**ARCH_VARIANTS, **MOE_VARIANTS}[aliases.get(arch, arch)]
    max_shard_size = overrides.pop("max_shard_size", None)
    config = getattr(transformers, class_name)(**{**_COMMON, **variant, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # Norm weights near 1, everything else like HF's init (std 0.02) but biases not zero.
            # Sinks near 1 in size, so that they take a real share of each softmax.
            scale = 1.0 if name.endswith("sinks") else 0.05
            param.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)
    out = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


def hf_logits(path: str | Path, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [len, vocab] for each sequence, each run alone (no padding)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in token_ids]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths (ids from 3 up: clear of special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(path: str | Path, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, each run alone (no padding to muddy the reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False)
        outs.append(gen[0, len(p) :].tolist())
    return outs
