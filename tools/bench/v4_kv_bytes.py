"""Bytes DeepSeek-V4 persists per raw token, against the same model persisting its
sliding window too (DeepSeek-V4.1 keeps the window in host memory only; V4 kept it
with the compressed entries). Logical bytes from the config, and what this engine
stores, measured: a tiny seeded V4 saves its blocks into an in-memory store.

    python -m tools.bench.v4_kv_bytes [--model FOLDER]

Per layer and raw token, in the KV dtype: the window is one K=V head of head_dim; a
CSA layer adds (head_dim + index_head_dim) / 4 (an entry and the indexer's key per 4
tokens), an HCA layer head_dim / 128. The first table is V4-Flash's published shape
(43 layers, head_dim 512, indexer keys of 128; layers 0-1 sliding only, the others
CSA and HCA in turn, CSA first: an assumption, the figure moves by < 1 % either way).
"""

import argparse
import tempfile
from dataclasses import dataclass

from shared.model.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Params
from tools.bench.raw_file import add_json_flag, write_rows


@dataclass(frozen=True, slots=True)
class PerToken:
    compressed: float
    """Bytes of compressed entries (and indexer keys) per raw token: what V4 persists."""
    window: float
    """Bytes of sliding-window K=V per raw token, were it persisted too."""

    @property
    def with_window(self) -> float:
        return self.compressed + self.window


def logical_bytes(p: DeepseekV4Params, head_dim: int, dtype_bytes: int) -> PerToken:
    compressed = sum(
        (head_dim + (p.index_head_dim if t == CSA else 0)) / r for t, r in zip(p.layer_types, p.compress_rates) if r
    )
    return PerToken(compressed * dtype_bytes, len(p.layer_types) * head_dim * dtype_bytes)


def v4_flash() -> DeepseekV4Params:
    kinds = [SLIDING, SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(41)]
    return DeepseekV4Params(
        layer_types=tuple(kinds), compress_rates=tuple({SLIDING: 0, CSA: 4, HCA: 128}[k] for k in kinds),
        q_lora_rank=1024, rope_head_dim=64, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
        index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    )  # fmt: skip


def measured_bytes(model: str, num_tokens: int = 256, block_size: int = 128) -> float:
    """Bytes the engine stored per raw token for a prompt of num_tokens on the checkpoint
    folder `model`: each block's payload (shared/kv/memory/region.py: the compressed groups'
    pages, their entries and indexer keys only), over the block's raw tokens. With blocks
    smaller than the HCA rate a block still carries one HCA row (empty in most blocks)."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine_request import EngineRequest
    from shared.engine.llm_engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams
    from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
    from shared.kv.transfer import KVTransferParams

    store = MemoryKVStore()
    engine = LLMEngine(EngineConfig(model=model, block_size=block_size), kv_connector=MemoryConnector(store))
    prompt = [3 + i % 1000 for i in range(num_tokens)]
    engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True)))
    while engine.has_unfinished_requests():
        engine.step()
    return sum(len(b) for b in store.blocks.values()) / (len(store.blocks) * block_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a V4 checkpoint folder (default: make-model's tiny V4)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    flash = logical_bytes(v4_flash(), 512, 2)
    print("V4-Flash shape, bf16, logical bytes per raw token:")
    print(f"  compressed only (V4.1, window not persisted): {flash.compressed:8.1f}")
    print(f"  with the sliding window persisted (V4):       {flash.with_window:8.1f}")
    print(f"  ratio: {flash.compressed / flash.with_window:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tools.make_model import make_model

            make_model(tmp, arch="deepseek_v4", seed=0, tokenizer=False)
            model = tmp
        from shared.model.config import ModelConfig

        config = ModelConfig.from_pretrained(model)
        assert config.deepseek_v4 is not None, f"{model} is not a DeepSeek-V4 checkpoint"
        tiny = logical_bytes(config.deepseek_v4, config.head_dim, 4)
        stored = {block: measured_bytes(model, block_size=block) for block in (128, 16)}
    print(f"{model}: float32, bytes per raw token")
    print(f"  logical: compressed {tiny.compressed:.1f}, with the window {tiny.with_window:.1f}")
    for block, value in stored.items():
        print(f"  this engine stores, blocks of {block}: {value:.1f}")
    rows = [
        {"shape": shape, "dtype": dtype, "kind": f"logical, {kind}", "bytes_per_token": value}
        for shape, dtype, figures in (("V4-Flash", "bfloat16", flash), ("tiny", "float32", tiny))
        for kind, value in (("compressed only", figures.compressed), ("window persisted", figures.with_window))
    ]
    rows += [{"shape": "tiny", "dtype": "float32", "kind": f"stored, blocks of {block}", "bytes_per_token": value}
             for block, value in stored.items()]  # fmt: skip
    write_rows(args.json, rows, model=args.model or "make-model's tiny V4")

if __name__ == "__main__":
    main()
