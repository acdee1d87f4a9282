"""SWA bounded replay, measured side by side in one run (ratios; absolute times only
mean something on the GPU machine).

Two seeded models of the default preset's shape that differ only in attention:
every layer full, or every other layer sliding (window 128). It prints
1. bytes persisted per prompt token (what a prefill writes to kvcache): hybrid / full;
2. time to first token of a 4k prompt 90 % cached, resumed with the sliding-window
   state from the host state cache, by bounded replay and by exact replay, against cold;
3. how far bounded replay drifts from a cold run: greedy token agreement over 256
   tokens, and the mean KL divergence of the next-token distributions while both runs
   still agree (their contexts are the same there).

    python -m tools.bench.swa_bench [--json PATH]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.transfer import KVTransferParams
from tools.bench.raw_file import write_json
from tools.make_model import make_model

WINDOW = 128
BLOCK = 16


def write_models(root: Path) -> tuple[str, str]:
    """The default preset as Qwen2 twice, same weights: all layers full, and every other layer sliding."""
    full, hybrid = root / "full", root / "hybrid"
    make_model(full, arch="qwen2", seed=0)
    make_model(hybrid, arch="qwen2", seed=0, sliding_window=WINDOW)
    return str(full), str(hybrid)


def run(engine: LLMEngine, request: EngineRequest) -> tuple[RequestOutput, float]:
    """The finished output and the seconds to its first token."""
    start = time.perf_counter()
    engine.add_request(request)
    first: float | None = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.request_id == request.request_id:
                first = time.perf_counter() - start
            if out.finished and out.request_id == request.request_id:
                final = out
    assert final is not None and first is not None
    return final, first


def engine(model: str, store: MemoryKVStore | None = None, **cfg: object) -> LLMEngine:
    connector = MemoryConnector(store) if store is not None else None
    return LLMEngine(EngineConfig(model=model, block_size=BLOCK, max_model_len=4096, **cfg), kv_connector=connector)  # type: ignore[arg-type]


def saved(model: str, prompt: list[int]) -> MemoryKVStore:
    """A store holding the persistent blocks of prompt, as a prefill leaves them in kvcache."""
    store = MemoryKVStore()
    save = KVTransferParams(save=True)
    run(engine(model, store), EngineRequest("save", prompt, SamplingParams(max_tokens=1), kv_transfer=save))
    return store


def resumed(model: str, prompt: list[int], cached: int, replay: str, params: SamplingParams) -> tuple[RequestOutput, float, LLMEngine]:
    """A request on an engine whose connector holds only the persistent KV of the first
    `cached` tokens; the time to first token includes loading them."""
    e = engine(model, saved(model, prompt[:cached]), swa_replay=replay)
    out, ttft = run(e, EngineRequest("resumed", prompt, params, kv_transfer=KVTransferParams(load=True)))
    return out, ttft, e


def recording_logits(e: LLMEngine) -> list[torch.Tensor]:
    """Keep the logits of every sampled row (bench instrumentation on one engine instance)."""
    seen: list[torch.Tensor] = []
    compute = e.model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        seen.append(logits.detach().float().cpu())
        return logits

    e.model.compute_logits = record  # type: ignore[method-assign]
    return seen


def run_swa_bench(prompt_len: int = 4000, cached_fraction: float = 0.9, drift_tokens: int = 256, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        full, hybrid = write_models(Path(tmp))
        vocab = json.loads((Path(full) / "config.json").read_text())["vocab_size"]
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()

        # 1. Persistent bytes per prompt token.
        per_token = {}
        for name, model in (("full", full), ("hybrid", hybrid)):
            blocks = saved(model, prompt[:1024]).blocks
            per_token[name] = sum(len(d) for d in blocks.values()) / (len(blocks) * BLOCK)
        results["persisted_bytes_per_token_full"] = per_token["full"]
        results["persisted_bytes_per_token_hybrid"] = per_token["hybrid"]
        results["persisted_ratio_hybrid_over_full"] = per_token["hybrid"] / per_token["full"]

        # 2. TTFT of a 90 % cached prompt (one new token generated).
        cached = int(prompt_len * cached_fraction) // BLOCK * BLOCK
        one = SamplingParams(max_tokens=1)
        _, cold = run(engine(hybrid), EngineRequest("cold", prompt, one))
        warm = engine(hybrid)
        run(warm, EngineRequest("turn1", prompt[: cached + 1], one))  # leaves its sliding state behind
        warm.kv.pool._cached = {k: b for k, b in warm.kv.pool._cached.items() if k[1] in warm.kv.layout.persistent_groups}
        _, state_hit = run(warm, EngineRequest("turn2", prompt, one))
        assert warm.kv.state_cache is not None and warm.kv.state_cache.num_hits == 1
        _, bounded, _ = resumed(hybrid, prompt, cached, "bounded", one)
        _, exact, _ = resumed(hybrid, prompt, cached, "exact", one)
        results.update(
            ttft_cold_s=cold,
            ttft_state_cache_over_cold=state_hit / cold,
            ttft_bounded_replay_over_cold=bounded / cold,
            ttft_exact_replay_over_cold=exact / cold,
        )

        # 3. Drift of bounded replay from a cold run.
        greedy = SamplingParams(max_tokens=drift_tokens, temperature=0.0, ignore_eos=True)
        short = prompt[:1000]
        cold_engine = engine(hybrid)
        cold_logits = recording_logits(cold_engine)
        cold_out, _ = run(cold_engine, EngineRequest("cold", short, greedy))
        replay_engine = engine(hybrid, saved(hybrid, short[:960]), swa_replay="bounded")
        replay_logits = recording_logits(replay_engine)
        replay_out, _ = run(replay_engine, EngineRequest("replay", short, greedy, kv_transfer=KVTransferParams(load=True)))
        a, b = cold_out.token_ids, replay_out.token_ids
        agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        kl = [
            torch.nn.functional.kl_div(r.log_softmax(-1), c.log_softmax(-1), log_target=True, reduction="sum").item()
            for c, r in zip(cold_logits[:agree], replay_logits[:agree])
        ]
        results.update(
            drift_tokens_equal_fraction=sum(x == y for x, y in zip(a, b)) / len(a),
            drift_first_divergence=agree,
            drift_mean_kl_while_equal=sum(kl) / max(len(kl), 1),
        )
    for key, value in results.items():
        print(f"{key:40s} {value:.4g}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swa_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--cached-fraction", type=float, default=0.9, help="of the prompt, rounded down to whole blocks")
    p.add_argument("--drift-tokens", type=int, default=256, help="greedy tokens compared for the drift")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="the figures, under the raw-file header")
    args = p.parse_args(argv)
    results = run_swa_bench(args.prompt_len, args.cached_fraction, args.drift_tokens, args.seed)
    if args.json:
        write_json(args.json, {"figures": results, "settings": {k: v for k, v in vars(args).items() if k != "json"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
