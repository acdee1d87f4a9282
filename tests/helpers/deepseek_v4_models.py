"""Tiny seeded DeepSeek-V4 checkpoints saved by transformers (the reference our V4 is
checked against): small dims, a window of 16, CSA every 4 tokens with an indexer that
keeps 6 entries, HCA every 16, several layer_types / mlp_layer_types mixes. Every
parameter is re-drawn at random (sinks near 1, so they take a real share of each
softmax; norm weights near 1) and the hash layers get a random tid2eid table.

The indexer has 16 heads: with ReLU'd scores of a few heads, several entries often
score exactly 0 and transformers' top-k then breaks the tie by tensor length (a
prefill of 50 tokens and one of 70 pick different entries for the same query)."""

from pathlib import Path
from typing import Any

import torch

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, q_lora_rank=24,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
    compress_rates={C: 4, H: 16}, sliding_window=16, o_groups=2, o_lora_rank=16,
    index_n_heads=16, index_head_dim=16, index_topk=6, hc_mult=2, max_position_embeddings=1024,
)

V4_VARIANTS: dict[str, dict[str, Any]] = {
    # Every kind of layer, a hash-routed first layer, YaRN on the compress rope.
    "mixed": dict(
        num_hidden_layers=4, layer_types=[S, C, H, C], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ),
    # transformers' default shape (HCA first, then CSA), two hash layers, sigmoid routing, 3 mHC streams.
    "hca_first": dict(
        num_hidden_layers=3, layer_types=[H, H, C], mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        scoring_func="sigmoid", hc_mult=3,
    ),
    # CSA only, no hash layer, a clamp low enough to bite.
    "csa_only": dict(num_hidden_layers=2, layer_types=[C, C], mlp_layer_types=["moe", "moe"], swiglu_limit=0.05),
}


def strong_mhc_(model: Any, generator: torch.Generator) -> None:
    """Re-draw every mHC parameter (the attention's and the MoE's hyper-connections of each
    layer and the hyper head) large enough that the mixes are far from uniform: ``fn`` of
    std 1/sqrt(hc * hidden) (each mix ~ N(0, 1) over the unit-RMS streams), ``base`` ~ N(0, 1)
    and scales ~ 2 +- 0.5, so comb's logits spread ~2.2 and its softmax rows are peaked
    (one entry often > 0.9): far from doubly stochastic before Sinkhorn and far from
    symmetric after it (hc >= 3; a 2x2 doubly stochastic matrix is symmetric)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            *owners, leaf = name.split(".")
            # By path segment: a top-level "hc_head.hc_fn" has no dot before its owner.
            if not {"attn_hc", "ffn_hc", "hc_head"} & set(owners):
                continue
            noise = torch.randn(param.shape, generator=generator)
            if leaf in ("fn", "hc_fn"):
                param.copy_(noise / param.shape[1] ** 0.5)
            elif leaf in ("base", "hc_base"):
                param.copy_(noise)
            else:  # scale, hc_scale
                param.copy_(2.0 + 0.5 * noise)


def save_tiny_v4(variant: str, path: str | Path, seed: int = 0, strong_mhc: bool = False, **overrides: Any) -> Path:
    """Build the tiny V4 ``variant``, randomise it with ``seed``, ``save_pretrained`` it
    into ``path`` (``max_shard_size`` in overrides goes to save_pretrained). With
    ``strong_mhc`` the mHC weights are re-drawn large (strong_mhc_): the default 0.05 noise
    leaves the mixing matrices nearly uniform, where a one-step Sinkhorn or a transposed
    matrix changes the logits by less than 1e-4."""
    import transformers

    max_shard_size = overrides.pop("max_shard_size", None)
    config = transformers.DeepseekV4Config(**{**_COMMON, **V4_VARIANTS[variant], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else (1.0 if name.endswith("sinks") else 0.05) * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                # top-k distinct experts per token id
                buffer.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[: buffer.shape[1]]
                                          for _ in range(buffer.shape[0])]))  # fmt: skip
    if strong_mhc:
        strong_mhc_(model, g)
    out = Path(path)
    model.save_pretrained(out, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    return out


def seeded_prompts(lengths: tuple[int, ...] = (5, 17, 40, 70), seed: int = 0) -> list[list[int]]:
    """Token-id prompts of these lengths, drawn from the tiny V4's vocabulary (ids 3-511):
    the prompts tests/gpu/test_gpu_deepseek_v4.py and tools/bench/v4_bf16_error.py share."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
