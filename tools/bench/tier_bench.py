"""Where a prefix hit comes from, side by side in one run: time to first token of a
prompt whose leading 90 % (rounded down to whole blocks) an earlier request left
behind, served from each tier of the KV chain, against cold.

  cold     nothing cached anywhere: the whole prompt is computed;
  device   the prefix is in the engine's own prefix cache (GPU memory, or the CPU's);
  host     the prefix was evicted from the device cache and comes back from the host
           tier (HostTierConnector: host memory, pinned on a GPU machine);
  kvcache  neither the device cache nor a host tier holds it: it comes from the
           kvcache service (gRPC + LMDB, a real process) into an engine with the host
           tier off, as a worker on another machine would get it.

The chain is the workers' (shared/stage/worker.py): PeerConnector -> HostTierConnector
-> KVCacheConnector, and PeerConnector -> KVCacheConnector with the host tier off.
Both engines share one model in memory. The device cache is emptied the way a busy
worker empties it: the engine's pool is two requests deep and a flood of unrelated
prompts (which save nothing) evicts the prefix under LRU; the host and kvcache rows
then prove it (they must load every prefix block).

Each round uses a fresh random prefix P and a prompt Q = P + tail:
  1. cold      Q (load on, save off: it pays the same lookups as the hits, stores nothing);
  2. flood     evicts Q from the device cache;
  3. writer    W = P + another tail, save on, waiting for the save: P is stored in the
               host tier and in kvcache (and left in the device cache);
  4. device    Q, loading nothing;
  5. flood     evicts P from the device cache (the host tier and kvcache keep it);
  6. host      Q loads P from the host tier;
  7. kvcache   Q on the other engine (no host tier) loads P from kvcache.
Measured requests generate one greedy token and save nothing, so every hit is
exactly P. TTFT runs from add_request to the step that returns the first token.
Every round checks, and the run fails loudly otherwise (after writing its files):
each hit came from the tier it is named after and nowhere else (cached tokens, blocks
loaded, the host tier's and kvcache's own hit counters); the prefix KV a load brought
is, byte for byte, the KV the writer computed; the first token is the cold run's
(unless cold's logits have a near-tie there) and its logits are within the dtype's
tolerance of cold's. A warm-up round (same steps, not reported) runs first. Medians
over the rounds are reported.

    python -m tools.bench.tier_bench --model PATH --device cuda --dtype bfloat16 \
        --prompt-len 4096 --repeats 3 --out docs/perf/tiers

Without --model it makes the tiny seeded model in a temporary folder. nats-server
must be installed (the kvcache service connects to NATS).
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.engine.config import EngineConfig
from shared.engine.dtypes import torch_dtype
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.base import KVConnector
from shared.kv.connectors.host_tier import HostTierConnector
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.connectors.peer import PeerConnector
from shared.kv.memory.coordinator import blocks_for_one_request
from shared.kv.transfer import KVTransferParams
from shared.kv.wire.client import KVCacheClient
from shared.model.loader import load_model
from shared.model.interface import CausalLM
from shared.runtime.settings import env_name
from tools.bench.raw_file import run_header, write_json, write_text
from tools.launch.up import Mesh

TIERS = ("cold", "device", "host", "kvcache")
_LEGEND = {
    "cold": "nothing cached: the whole prompt computed",
    "device": "the engine's own prefix cache",
    "host": "evicted from the device cache, loaded from the host tier",
    "kvcache": "no device cache, no host tier: loaded from kvcache (gRPC + LMDB)",
}
DEVICE_POOL_REQUESTS = 2
"""Without --kv-cache-memory-bytes, the device pool holds this many requests: small
enough that a flood of a few prompts evicts a prefix, as on a busy worker."""
_LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-3}
# bfloat16: on the H200 (8B shape, 4k prompt) a device hit's logits, which load nothing,
# differ from cold's by 3-4 % of their largest magnitude: the tail is computed in a step
# of its own. A loaded tier is held to the device hit's logits much more tightly.
_SAME_AS_DEVICE_HIT = 1e-3
"""A hit's first token may differ from cold's only on a near-tie of cold's logits:
within this fraction of their largest magnitude (the tail is computed in other chunks)."""


class TierBenchError(RuntimeError):
    """A hit did not come from the tier it is named after, or its first token is wrong."""


# -- the kvcache service ---------------------------------------------------------------


@contextmanager
def kvcache_service(workdir: Path, capacity_bytes: int, timeout_s: float = 60.0) -> Iterator[str]:
    """nats-server and `python -m services.kvcache` with its LMDB store in workdir, started
    as `infermesh up` starts them (Mesh.start_store; open: this process's connectors carry
    no token); yields the address workers dial. Both stop on exit."""
    env = {env_name("kvcache", "capacity_bytes"): str(capacity_bytes), env_name("worker", "drain_timeout_s"): "5"}
    store = Mesh("(no model)", 0, 0, state_dir=workdir, extra_env=env, auth=False)
    try:
        store.start_store(timeout_s)
        yield store.kv_address
    finally:
        store.stop()


def kvcache_hits(address: str) -> int:
    """Blocks kvcache has served so far (its own counter: a lookup is no hit, a Get is)."""

    async def stats() -> int:
        async with KVCacheClient(address, timeout_s=10.0) as client:
            return (await client.stats()).num_hits

    return asyncio.run(stats())


def connector_chain(address: str, host_bytes: int) -> tuple[KVConnector, HostTierConnector | None]:
    """The workers' chain (serve_engine_stage): direct peer copies (none here), then the
    host tier when host_bytes > 0, then kvcache. Returns it and its host tier."""
    # Every hit loaded: the bench measures the tier itself. A worker's default loads
    # only hits that beat recomputing them (kvcache.load_when_faster, load_cost.py).
    store: KVConnector = KVCacheConnector(address, load_when_faster=False)
    host = HostTierConnector(store, host_bytes) if host_bytes else None
    return PeerConnector(host or store, lambda instance_id, request_id: None), host


# -- one request -----------------------------------------------------------------------


class FirstLogits:
    """Keeps (on the device, no sync) the logits of the last row the model sampled:
    during a measured request, its first token's."""

    def __init__(self, model: CausalLM) -> None:
        self.last: torch.Tensor | None = None
        compute = model.compute_logits

        def record(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute(hidden)
            if logits.shape[0]:
                self.last = logits[-1].detach().float().clone()
            return logits

        model.compute_logits = record  # type: ignore[method-assign]


@dataclass(slots=True)
class Sample:
    """One measured request."""

    ttft_s: float
    first_token: int
    num_cached_tokens: int
    num_loaded_blocks: int
    host_tier_hit_blocks: int = 0
    """Blocks the host tier served during the request (its counter's increase)."""
    kvcache_hit_blocks: int = 0
    """Blocks kvcache served during the request (its counter's increase)."""
    logits_rel_err_vs_cold: float = 0.0
    """max|logits - cold's| / max|cold's| of the first token."""
    first_token_equals_cold: bool = True
    kv_equals_computed: bool | None = None
    """The loaded prefix's KV, byte for byte, is the KV the writer computed (host, kvcache)."""


@dataclass
class RoundResult:
    samples: dict[str, Sample] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    computed_kv: torch.Tensor | None = None
    """The prefix's KV bytes as the writer computed them (read in the device row)."""


def prefix_kv(engine: LLMEngine, out: RequestOutput, num_blocks: int) -> torch.Tensor | None:
    """The KV bytes [blocks, block_bytes] of the request's first num_blocks blocks as this
    engine's prefix cache holds them now; None if it lacks one."""
    assert out.kv is not None
    bs, tokens = engine.kv.block_size, out.prompt_token_ids
    ids: dict[int, list[int]] = {g: [] for g in engine.kv.layout.persistent_groups}
    for i, block_hash in enumerate(out.kv.block_hashes[:num_blocks]):
        for g, run in ids.items():
            block = engine.kv.pool.lookup(block_hash, g, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                return None
            run.append(block.block_id)
    return engine.runner.kv_region.read_payloads(ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drive(engine: LLMEngine, request: EngineRequest) -> tuple[RequestOutput, float]:
    """Run one request to its end (and the engine until nothing is left, saves included);
    returns its last output and the seconds from add_request to its first token."""
    _sync(engine.runner.device)
    start = time.perf_counter()
    engine.add_request(request)
    first: float | None = None
    final: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request.request_id:
                continue
            if first is None and out.new_token_ids:
                first = time.perf_counter() - start
            if out.finished:
                final = out
    assert final is not None and first is not None, f"{request.request_id} never finished"
    return final, first


# -- the bench -------------------------------------------------------------------------


@dataclass
class _Setup:
    tiered: LLMEngine
    """Device cache + host tier + kvcache."""
    remote: LLMEngine
    """Device cache + kvcache (host tier off): the kvcache row."""
    host: HostTierConnector
    address: str
    logits: FirstLogits
    vocab: int
    prompt_len: int
    cached: int
    block_size: int
    tolerance: float


class _Round:
    """One round's steps (module docstring), each request checked as it ends."""

    def __init__(self, s: _Setup, index: int, rng: np.random.Generator, failures: list[str]) -> None:
        self.s = s
        self.tag = f"r{index}"
        self.failures = failures
        prefix = rng.integers(10, s.vocab, s.cached).tolist()
        tail, other = rng.integers(10, s.vocab, (2, s.prompt_len - s.cached)).tolist()
        if other[0] == tail[0]:  # the writer's chain must part from Q's right after P
            other[0] = 10 + (tail[0] - 10 + 1) % (s.vocab - 10)
        self.prompt, self.writer = prefix + tail, prefix + other
        self.flood_rng = np.random.default_rng(rng.integers(1 << 62))
        self.num_flooded = 0
        self.result = RoundResult()

    def fail(self, message: str) -> None:
        self.failures.append(f"{self.tag}: {message}")

    def run(self) -> RoundResult:
        s = self.s
        self.measure("cold", s.tiered)
        self.flood(s.tiered)
        self.write()
        self.measure("device", s.tiered)
        self.flood(s.tiered)
        self.measure("host", s.tiered)
        self.measure("kvcache", s.remote)
        self.result.computed_kv = None  # a prompt's KV: not kept past its round
        return self.result

    def flood(self, engine: LLMEngine) -> None:
        """Prompts of no prefix of ours, saving nothing, until every block that was free
        has been handed out again: the least recently used cached blocks (ours) go first."""
        s = self.s
        per_prompt = s.prompt_len // s.block_size
        for _ in range(-(-engine.kv.pool.num_blocks // per_prompt)):
            prompt = self.flood_rng.integers(10, s.vocab, s.prompt_len).tolist()
            self.num_flooded += 1
            _drive(engine, EngineRequest(f"{self.tag}-flood-{self.num_flooded}", prompt, SamplingParams(max_tokens=1)))

    def write(self) -> None:
        """The earlier request: W = P + another tail, stored in the host tier and kvcache
        before the next step starts (its last output waits for the save)."""
        s = self.s
        save = KVTransferParams(load=True, save=True, wait_for_save=True)
        out, _ = _drive(s.tiered, EngineRequest(f"{self.tag}-writer", self.writer, SamplingParams(max_tokens=1), kv_transfer=save))
        expected = len(self.writer) // s.block_size
        if out.num_cached_tokens:
            self.fail(f"writer: {out.num_cached_tokens} tokens cached, expected none (the flood did not evict)")
        if out.kv is None or out.kv.save_error is not None or out.kv.num_saved_blocks != expected:
            saved = None if out.kv is None else (out.kv.num_saved_blocks, out.kv.save_error)
            self.fail(f"writer: saved {saved}, expected {expected} blocks")

    def measure(self, tier: str, engine: LLMEngine) -> None:
        s = self.s
        host_before, kv_before = s.host.num_hit_blocks, kvcache_hits(s.address)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request = EngineRequest(f"{self.tag}-{tier}", self.prompt, params, kv_transfer=KVTransferParams(load=True))
        s.logits.last = None
        out, ttft = _drive(engine, request)
        assert s.logits.last is not None
        sample = Sample(
            ttft_s=ttft,
            first_token=out.token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            num_loaded_blocks=out.kv.num_loaded_blocks if out.kv is not None else 0,
            host_tier_hit_blocks=s.host.num_hit_blocks - host_before,
            kvcache_hit_blocks=kvcache_hits(s.address) - kv_before,
        )
        self.result.samples[tier] = sample
        self.result.logits[tier] = s.logits.last
        blocks = s.cached // s.block_size
        if tier == "device":
            self.result.computed_kv = prefix_kv(engine, out, blocks)
        elif tier != "cold":
            loaded, computed = prefix_kv(engine, out, blocks), self.result.computed_kv
            sample.kv_equals_computed = loaded is not None and computed is not None and torch.equal(loaded, computed)
        self.check(tier, sample)

    def check(self, tier: str, got: Sample) -> None:
        """The hit came from `tier` and nowhere else, and its first token is cold's."""
        s = self.s
        blocks = s.cached // s.block_size
        expected = {
            "cold": (0, 0, 0, 0),
            "device": (s.cached, 0, 0, 0),
            "host": (s.cached, blocks, blocks, 0),
            "kvcache": (s.cached, blocks, 0, blocks),
        }[tier]
        seen = (got.num_cached_tokens, got.num_loaded_blocks, got.host_tier_hit_blocks, got.kvcache_hit_blocks)
        if seen != expected:
            self.fail(
                f"{tier}: (cached tokens, loaded blocks, host tier hits, kvcache hits) = {seen}, expected {expected}"
            )
        if tier in ("host", "kvcache") and not got.kv_equals_computed:
            self.fail(f"{tier}: the loaded prefix KV is not, byte for byte, the KV the writer computed")
        if tier == "cold":
            return
        cold_logits = self.result.logits["cold"]
        cold_token = self.result.samples["cold"].first_token
        logits = self.result.logits[tier]
        scale = cold_logits.abs().max().item()
        got.logits_rel_err_vs_cold = (logits - cold_logits).abs().max().item() / scale
        got.first_token_equals_cold = got.first_token == cold_token
        margin = (cold_logits[cold_token] - cold_logits[got.first_token]).item()
        if not got.first_token_equals_cold and margin > s.tolerance * scale:
            self.fail(f"{tier}: first token {got.first_token}, cold's {cold_token} (no near-tie: margin {margin:.3g})")
        if not got.logits_rel_err_vs_cold <= s.tolerance:  # NaN fails too
            self.fail(f"{tier}: first-token logits differ from cold's by {got.logits_rel_err_vs_cold:.3g} (relative)")
        device = self.result.logits.get("device")
        if tier in ("host", "kvcache") and device is not None:
            # The same computation as the device hit over the same KV bytes: the same logits.
            off = (logits - device).abs().max().item() / scale
            if not off <= _SAME_AS_DEVICE_HIT:
                self.fail(f"{tier}: first-token logits differ from the device hit's by {off:.3g} (relative)")


def _summary(rounds: list[RoundResult], block_bytes: int) -> dict[str, dict[str, Any]]:
    cold_ttft = statistics.median(r.samples["cold"].ttft_s for r in rounds)
    rows: dict[str, dict[str, Any]] = {}
    for tier in TIERS:
        samples = [r.samples[tier] for r in rounds]
        ttft = statistics.median(x.ttft_s for x in samples)
        loaded = statistics.median(x.num_loaded_blocks for x in samples)
        rows[tier] = {
            "ttft_ms": 1e3 * ttft,
            "vs_cold": ttft / cold_ttft,
            "num_cached_tokens": statistics.median(x.num_cached_tokens for x in samples),
            "num_loaded_blocks": loaded,
            "loaded_bytes": loaded * block_bytes,
            "tier_hit_blocks": {
                "host": statistics.median(x.host_tier_hit_blocks for x in samples),
                "kvcache": statistics.median(x.kvcache_hit_blocks for x in samples),
            }.get(tier),
            "first_token_equals_cold": all(x.first_token_equals_cold for x in samples),
            "kv_equals_computed": None if tier in ("cold", "device") else all(x.kv_equals_computed for x in samples),
            "max_logits_rel_err_vs_cold": max(x.logits_rel_err_vs_cold for x in samples),
            "samples": [asdict(x) for x in samples],
        }
    return rows


def _table(rows: dict[str, dict[str, Any]]) -> list[str]:
    header = (
        "| tier | TTFT ms | vs cold | cached tokens | loaded blocks | loaded MiB | tier hit blocks | "
        "loaded KV = computed | first token = cold | logits rel err |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for tier, row in rows.items():
        hits = "-" if row["tier_hit_blocks"] is None else f"{row['tier_hit_blocks']:.0f}"
        same_kv = {None: "-", True: "yes", False: "NO"}[row["kv_equals_computed"]]
        lines.append(
            f"| {tier} | {row['ttft_ms']:.2f} | {row['vs_cold']:.3f} | {row['num_cached_tokens']:.0f} | "
            f"{row['num_loaded_blocks']:.0f} | {row['loaded_bytes'] / (1 << 20):.1f} | {hits} | {same_kv} | "
            f"{'yes' if row['first_token_equals_cold'] else 'NO'} | {row['max_logits_rel_err_vs_cold']:.2g} |"
        )
    return lines


def run_tier_bench(
    model: str | None = None,
    prompt_len: int = 4096,
    cached_fraction: float = 0.9,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    kv_cache_memory_bytes: int | None = None,
    host_kv_cache_bytes: int | None = None,
    block_size: int = 16,
    seed: int = 0,
    out: str | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Measure the four rows (module docstring), print the table, write tiers.json and
    tiers.md into `out` (when given) and return the figures. Raises TierBenchError, after
    writing, when a hit did not come from its tier or its first token is wrong.
    kv_cache_memory_bytes: the engines' device pools (None: DEVICE_POOL_REQUESTS
    requests deep; a big pool makes each flood longer). host_kv_cache_bytes: None takes
    EngineConfig's default."""
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be at least 1 and warmup at least 0")
    cached = int(prompt_len * cached_fraction) // block_size * block_size
    if not 0 < cached < prompt_len:
        raise ValueError(f"{cached_fraction:.0%} of {prompt_len} tokens is no whole block short of the prompt")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="infermesh-tiers-")))
        made = model is None
        if model is None:
            from tools.make_model import make_model

            model = str(tmp / "model")
            make_model(model, tokenizer=False)  # token-id prompts
        max_model_len = prompt_len + block_size
        torch_device = torch.device(device)
        net = load_model(model, dtype=torch_dtype(dtype), device=torch_device)
        sizes: dict[str, Any] = (
            {"kv_cache_memory_bytes": kv_cache_memory_bytes}
            if kv_cache_memory_bytes is not None
            else {"num_kv_blocks": DEVICE_POOL_REQUESTS * blocks_for_one_request(net.kv_layout, max_model_len, block_size)}
        )
        if host_kv_cache_bytes is not None:
            if host_kv_cache_bytes <= 0:
                raise ValueError("the host tier is one of the rows: host_kv_cache_bytes must be positive")
            sizes["host_kv_cache_bytes"] = host_kv_cache_bytes
        config = EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, max_model_len=max_model_len, **sizes
        )
        rounds_total = repeats + warmup
        prompt_blocks = prompt_len // block_size
        upper_block_bytes = len(net.kv_layout.groups) * net.kv_bytes_per_block(block_size, torch_dtype(dtype))
        kv_capacity = max(1 << 30, 2 * rounds_total * prompt_blocks * upper_block_bytes)
        address = stack.enter_context(kvcache_service(tmp / "kvcache", kv_capacity))

        chain, host = connector_chain(address, config.host_kv_cache_bytes)
        assert host is not None
        tiered = LLMEngine(config, net, detokenize=False, kv_connector=chain)
        stack.callback(tiered.close)
        block_bytes = tiered.runner.kv_region.block_bytes  # what a connector moves per block
        if config.host_kv_cache_bytes < prompt_blocks * block_bytes:
            raise ValueError(
                f"the host tier ({config.host_kv_cache_bytes} bytes) must hold one prompt "
                f"({prompt_blocks} blocks of {block_bytes} bytes)"
            )
        remote_chain, _ = connector_chain(address, 0)
        remote = LLMEngine(config, net, detokenize=False, kv_connector=remote_chain)
        stack.callback(remote.close)
        setup = _Setup(
            tiered, remote, host, address, FirstLogits(net), net.config.vocab_size, prompt_len, cached, block_size,
            _LOGIT_TOLERANCE[dtype],
        )  # fmt: skip
        run = {
            "model": None if made else model,
            "device": torch.cuda.get_device_name(torch_device) if torch_device.type == "cuda" else "cpu",
            "dtype": dtype,
            "prompt_len": prompt_len,
            "cached_tokens": cached,
            "repeats": repeats,
            "warmup": warmup,
            "block_bytes": block_bytes,
            "device_pool_blocks": tiered.kv.pool.num_blocks,
            "host_tier_bytes": config.host_kv_cache_bytes,
        }
        print(" ".join(f"{k}={v if v is not None else 'tiny (made)'}" for k, v in run.items()), flush=True)
        failures: list[str] = []
        rng = np.random.default_rng(seed)
        rounds = [_Round(setup, i, rng, failures).run() for i in range(rounds_total)][warmup:]
    rows = _summary(rounds, block_bytes)
    for tier in TIERS:
        print(f"  {tier:<8} {_LEGEND[tier]}")
    table = _table(rows)
    print("\n".join(table))
    for failure in failures:
        print(f"CHECK FAILED {failure}", file=sys.stderr)
    figures = {"config": {**run, "engine": asdict(config)}, "rows": rows, "failures": failures}
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        header = run_header()
        write_json(folder / "tiers.json", figures, header)
        md = [
            f"TTFT of a {prompt_len}-token prompt with {cached} tokens ({cached / prompt_len:.0%}) cached, from each "
            f"tier against cold; medians of {repeats} rounds on {run['device']} ({dtype}). vs cold: TTFT / cold's.",
            "",
        ]
        if command:
            md += ["```sh", command, "```", ""]
        md += [*table, "", *(f"- {tier}: {_LEGEND[tier]}" for tier in TIERS)]
        if failures:
            md += ["", "CHECKS FAILED:", *(f"- {f}" for f in failures)]
        write_text(folder / "tiers.md", "\n".join(md), header)
    if failures:
        raise TierBenchError("; ".join(failures))
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.tier_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint folder (default: the tiny seeded model, made in a temporary folder)")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--cached-fraction", type=float, default=0.9, help="of the prompt, rounded down to whole blocks")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (medians are reported)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not reported")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(_LOGIT_TOLERANCE))
    p.add_argument("--kv-cache-memory-bytes", type=int, help=f"device pool (default: {DEVICE_POOL_REQUESTS} requests)")
    p.add_argument("--host-kv-cache-bytes", type=int, help="host tier (default: EngineConfig's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for tiers.json and tiers.md")
    args = p.parse_args(argv)
    command = "python -m tools.bench.tier_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        run_tier_bench(
            args.model, args.prompt_len, args.cached_fraction, args.repeats, args.warmup, args.device, args.dtype,
            args.kv_cache_memory_bytes, args.host_kv_cache_bytes, args.block_size, args.seed, args.out, command,
        )  # fmt: skip
    except TierBenchError as exc:
        print(f"tier_bench: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
