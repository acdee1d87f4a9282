"""DeepSeek-V4's config (torch-free, beside models/deepseek_v4.py): what its attention
and residual stream compute (``DeepseekV4Params``, held in ``ModelConfig.deepseek_v4``),
its MoE, its two rotaries, and the tiny config.json make-model writes for it (``CONFIG``).

Read as transformers 5.24's ``DeepseekV4Config`` reads it: ``layer_types`` (or the
legacy per-layer ``compress_ratios``), ``compress_rates`` per attention kind (or the
legacy ``compress_rate_csa``/``compress_rate_hca``), ``mlp_layer_types`` (or
``num_hash_layers``), ``partial_rotary_factor`` (or ``qk_rope_head_dim``), and the two
rotaries: "main" for sliding-only layers, "compress" (YaRN where configured) for the
compressed layers, their compressors and the indexer.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from shared.model.arch_config import ArchConfig, ArchTraits, RopeConfig, parse_rope
from shared.model.moe_config import TEST_EXPERTS, MlpLayerType, MoEConfig

V4LayerType = Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
SLIDING: V4LayerType = "sliding_attention"
CSA: V4LayerType = "compressed_sparse_attention"
HCA: V4LayerType = "heavily_compressed_attention"
V4_LAYER_TYPES: tuple[V4LayerType, ...] = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE: Mapping[int, V4LayerType] = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES: Mapping[str, int] = {CSA: 4, HCA: 128}


@dataclass(frozen=True, slots=True)
class DeepseekV4Params:
    """V4's attention, compressors, indexer and hyper-connections (the MoE is a MoEConfig)."""

    layer_types: tuple[V4LayerType, ...]
    compress_rates: tuple[int, ...]
    """Per layer: tokens per compressed entry (4 for CSA, 128 for HCA), 0 for sliding-only."""
    q_lora_rank: int
    rope_head_dim: int
    """The trailing channels of each 512-wide head that carry rope (64 in the real model)."""
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        for kind, rate in zip(self.layer_types, self.compress_rates):
            if kind != SLIDING and rate < 1:
                raise ValueError(f"compress_rates[{kind!r}] must be at least 1, got {rate}")
        if self.rope_head_dim % 2:
            raise ValueError(f"the rope part of a head must be even, got {self.rope_head_dim}")

    def layer_type(self, layer_idx: int) -> V4LayerType:
        return self.layer_types[layer_idx]

    def uses_compress_rope(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] != SLIDING

    @property
    def state_window(self) -> int:
        """Raw tokens of per-request state a query needs behind it: the sliding window,
        and the compressors' unfinished windows (2 m for CSA's overlapping windows, m for HCA)."""
        needs = [self.sliding_window]
        for kind, rate in zip(self.layer_types, self.compress_rates):
            needs.append(2 * rate if kind == CSA else rate if kind == HCA else 0)
        return max(needs)


def parse_deepseek_v4(d: Mapping[str, Any], num_layers: int, head_dim: int) -> DeepseekV4Params:
    rates = dict(_DEFAULT_RATES)
    rates.update(d.get("compress_rates") or {})
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = int(d["compress_rate_csa"])
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = int(d["compress_rate_hca"])
    layer_types = d.get("layer_types")
    if layer_types is None and d.get("compress_ratios") is not None:
        layer_types = [_RATIO_TO_TYPE[int(r)] for r in d["compress_ratios"]]
    if layer_types is None:  # transformers' default: 2 HCA, then CSA and HCA interleaved
        layer_types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    layer_types = list(layer_types)[:num_layers]
    if len(layer_types) != num_layers or any(t not in V4_LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must be {num_layers} of {V4_LAYER_TYPES}, got {layer_types}")
    partial = d.get("partial_rotary_factor")
    if partial is None:
        partial = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") else 64 / 512
    return DeepseekV4Params(
        layer_types=tuple(layer_types),
        compress_rates=tuple(0 if t == SLIDING else int(rates[t]) for t in layer_types),
        q_lora_rank=int(d.get("q_lora_rank", 1024)),
        rope_head_dim=int(head_dim * float(partial)),
        sliding_window=int(d.get("sliding_window", 128)),
        o_groups=int(d.get("o_groups", 8)),
        o_lora_rank=int(d.get("o_lora_rank", 1024)),
        index_n_heads=int(d.get("index_n_heads", 64)),
        index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
    )


def deepseek_v4_moe(d: Mapping[str, Any], num_layers: int) -> tuple[MoEConfig, tuple[MlpLayerType, ...]]:
    """Every layer sparse: the first ``num_hash_layers`` (or those ``mlp_layer_types``
    names) hash-routed; scores renormalised with an epsilon of 1e-20 and scaled, a
    selection-only bias on the learned routers, one shared SiLU expert of the routed
    experts' size (as transformers' DeepseekV4MLP), the ``swiglu_limit`` clamp."""
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        num_hash = int(d.get("num_hash_layers", 3))
        kinds = ["hash_moe"] * min(num_layers, num_hash) + ["moe"] * max(0, num_layers - num_hash)
    kinds = list(kinds)[:num_layers]
    if len(kinds) != num_layers or any(k not in ("hash_moe", "moe") for k in kinds):
        raise ValueError(f"mlp_layer_types must be {num_layers} of ('hash_moe', 'moe'), got {kinds}")
    size = int(d.get("moe_intermediate_size", 2048))
    limit = d.get("swiglu_limit", 10.0)
    moe = MoEConfig(
        num_experts=int(d.get("n_routed_experts", d.get("num_local_experts", 256))),
        top_k=int(d.get("num_experts_per_tok", 6)),
        intermediate_size=size,
        scoring=d.get("scoring_func", "sqrtsoftplus"),
        norm_topk_prob=True,
        renorm_eps=1e-20,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        selection_bias=True,
        swiglu_limit=None if limit is None else float(limit),
        num_shared_experts=int(d.get("n_shared_experts", 1)),
        shared_intermediate_size=size,
    )
    return moe, tuple(kinds)  # type: ignore[arg-type]


def deepseek_v4_ropes(d: Mapping[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """DeepSeek-V4's (main, compress) rotaries, as DeepseekV4Config nests them under
    ``rope_parameters``; a flat (older) spelling is nested as transformers does: main
    is plain rope at ``rope_theta``, compress the flat parameters (YaRN, where given)
    at ``compress_rope_theta`` with an attention factor of 1 (V4 does not scale cos/sin)."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        compress = {"rope_type": "default", **flat, "rope_theta": d.get("compress_rope_theta", 160000.0)}
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    # The rope covers partial_rotary_factor of the head: DeepseekV4Params.rope_head_dim.
    main.pop("partial_rotary_factor", None)
    compress.pop("partial_rotary_factor", None)
    return parse_rope({"rope_parameters": main}, max_pos), parse_rope({"rope_parameters": compress}, max_pos)


def parse_fields(d: Mapping[str, Any], num_layers: int, head_dim: int, max_pos: int) -> Mapping[str, Any]:
    """V4's own ModelConfig fields: the MoE, ``deepseek_v4``, the experts' size as the
    intermediate size, the main and compress ropes, and sinks in every layer."""
    moe, mlp_layer_types = deepseek_v4_moe(d, num_layers)
    v4 = parse_deepseek_v4(d, num_layers, head_dim)
    main, compress = deepseek_v4_ropes(d, max_pos)
    return {
        "intermediate_size": int(d["moe_intermediate_size"]),
        "rope": main,
        "moe": moe,
        "mlp_layer_types": mlp_layer_types,
        "attention_sinks": True,
        "deepseek_v4": v4,
        "compress_rope": compress,
    }


TEST_SLIDING_WINDOW = 128  # DeepseekV4Config's default (and the real model's), when no window is asked for


def hf_test_config(model_type: str, config: dict[str, Any], preset: Mapping[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """V4's keys at the preset's width: one K=V head twice as wide as hidden/heads (V4:
    512 for 4096/64... scaled down), a quarter of it rotated, YaRN on the compress rope,
    the real compression rates (4, 128) and indexer top-k over 16 heads, 4 mHC streams,
    the MoE experts of TEST_EXPERTS (every layer sparse, the first hash-routed). A
    preset's ``deepseek_v4`` mapping overrides any of these (v4-flash-8l: the real dims).
    Layers that a preset does not name: sliding-only first (as V4-Flash's first two),
    then CSA and HCA (compression 4 and 128, the real rates) in turn; the first layer
    hash-routed. Every kind of layer occurs from 3 layers on."""
    for key in ("intermediate_size", "rope_parameters"):
        del config[key]  # V4 names them moe_intermediate_size and nests its two ropes
    v4 = preset.get("deepseek_v4", {})
    num_layers, hidden, max_pos = preset["num_hidden_layers"], preset["hidden_size"], preset["max_position_embeddings"]
    head_dim = v4.get("head_dim", 2 * hidden // preset["num_attention_heads"])
    rotary = v4.get("partial_rotary_factor", 0.25)
    yarn_factor = v4.get("yarn_factor", 4.0)
    default_types = [SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(num_layers - 1)]
    layer_types = list(v4.get("layer_types", default_types))
    mlp_layer_types = list(v4.get("mlp_layer_types", ["hash_moe"] + ["moe"] * (num_layers - 1)))
    config.update({
        "attention_bias": False,
        "compress_rates": {CSA: 4, HCA: 128},
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
        "moe_intermediate_size": v4.get("moe_intermediate_size", TEST_EXPERTS["moe_intermediate_size"]),
        "n_routed_experts": v4.get("n_routed_experts", TEST_EXPERTS["num_experts"]),
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": v4.get("num_experts_per_tok", TEST_EXPERTS["num_experts_per_tok"]),
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
        "sliding_window": TEST_SLIDING_WINDOW if sliding_window is None else sliding_window,
        "swiglu_limit": 10.0,
    })  # fmt: skip
    return config


PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
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
                        layer_types=(SLIDING,) * 2 + (CSA, HCA) * 3,
                        mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 5,
                    )
                ),
            )
        ),
    }
)


CONFIG = ArchConfig(
    architectures=MappingProxyType(
        # One shared K=V head of 512, a window in every layer (besides the compressed
        # entries of CSA/HCA layers; see DeepseekV4Params).
        # Trained for SWA bounded replay (the V4 report): bounded is its default swa_replay.
        {"DeepseekV4ForCausalLM": ArchTraits("deepseek_v4", False, False, False, False, "all", 512,
                                             trained_for_bounded_replay=True)}  # fmt: skip
    ),
    test_config=hf_test_config,
    parse=parse_fields,
    presets=PRESETS,
)
