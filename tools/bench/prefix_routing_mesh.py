"""Prefill routing when every request shares one system prompt (issue 32, point 4), on
a real mesh: the figure tools/bench/prefix_routing_bench.py simulates, measured through
`tools.launch.up.Mesh` as deployed (nats-server, kvcache, --prefill prefill instances,
one decode instance, the balancer's HTTP API). Two meshes of the same shape run at once:

  kv cost      balancer.kv_overlap_weight at its default (Dynamo's KV-router cost:
               weight x blocks to compute + blocks queued);
  prefix first the weight --prefix-first-weight (1e9): one block held outweighs any
               queue, which is the routing before issue 32.

Every request is the same seeded --system-tokens token prompt followed by
--user-tokens tokens of its own, max_tokens --max-tokens; --concurrency clients send
--requests requests per round to each mesh, the meshes taking turns (order rotated by
round) for --rounds rounds after a warm-up of a different system prompt and, as the
simulation starts, one request of the measured prompt sent alone (the day's first: one
instance holds the system prompt when the load starts; --no-first-request: none does). Printed per
round and mesh: the requests each prefill instance completed (its own Prometheus
series infermesh_prefill_requests_total{outcome="ok"}, read on its metrics port before
and after), max/even (the busiest instance over the mean; issue 32's target <= 1.5)
and the prefix hit rate (usage.prompt_tokens_details.cached_tokens over prompt_tokens,
from the API's answers), with the prefill instances' cached tokens by source."""

import argparse
import asyncio
import statistics
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from shared.runtime.settings import env_name
from tools.bench.mesh_bench import bench_state, engine_setup, model_or_made
from tools.bench.openai_stream import RequestSpec
from tools.bench.prefix_routing_bench import max_over_even
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows
from tools.bench.serve_bench import LoadLevel, run_level
from tools.bench.workloads import Session
from tools.launch.up import Mesh, free_port

_OK = "infermesh_prefill_requests_total"
_CACHED = "infermesh_prefill_cached_tokens_total"
_WARMUP_SEED = 1_000_003


@dataclass(frozen=True, slots=True)
class Counts:
    """One prefill instance's series at a moment."""

    ok: float
    cached: dict[str, float]


def _instance_counts(port: int) -> Counts:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).raise_for_status().text
    ok = 0.0
    cached: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == _OK and s.labels.get("outcome") == "ok":
                ok += s.value
            elif s.name == _CACHED:
                cached[s.labels["source"]] = cached.get(s.labels["source"], 0.0) + s.value
    return Counts(ok, cached)


def _snapshot(mesh: Mesh) -> dict[str, Counts]:
    return {name: _instance_counts(port) for name, port in sorted(mesh.metrics_ports.items())
            if name.startswith("prefill-")}  # fmt: skip


@dataclass(slots=True)
class Round:
    per_instance: dict[str, int]
    hit_rate: float
    cached_by_source: dict[str, int]
    failed: int
    ttft_p50_ms: float
    """Through the whole mesh (prefill, the KV handoff, decode's first token), the machine's load in it."""

    @property
    def max_over_even(self) -> float:
        return max_over_even(self.per_instance)


def _prompts(n: int, system_tokens: int, user_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(10, vocab, size=system_tokens).tolist()
    return [system + rng.integers(10, vocab, size=user_tokens).tolist() for _ in range(n)]


def _sessions(prompts: list[list[int]], max_tokens: int) -> list[Session]:
    body = {"temperature": 0, "ignore_eos": True}
    specs = [RequestSpec(prompt=p, max_tokens=max_tokens, num_prompt_tokens=len(p), extra_body=body) for p in prompts]
    return [Session([lambda answers, spec=spec: spec]) for spec in specs]


async def _round(client: httpx.AsyncClient, model: str, mesh: Mesh, prompts: list[list[int]], max_tokens: int,
                 concurrency: int) -> Round:  # fmt: skip
    before = _snapshot(mesh)
    results, _, _ = await run_level(client, model, _sessions(prompts, max_tokens), LoadLevel(concurrency=concurrency))
    after = _snapshot(mesh)
    ok = [r for r in results if r.success]
    prompt = sum(r.num_prompt_tokens for r in ok)
    sources = sorted({k for c in after.values() for k in c.cached})
    return Round(
        {name: int(after[name].ok - before[name].ok) for name in after},
        sum(r.num_cached_tokens for r in ok) / prompt if prompt else 0.0,
        {k: int(sum(after[n].cached.get(k, 0) - before[n].cached.get(k, 0) for n in after)) for k in sources},
        len(results) - len(ok),
        statistics.median(r.ttft_s for r in ok) * 1e3 if ok else float("nan"),
    )


async def _measure(meshes: dict[str, Mesh], args: argparse.Namespace, vocab: int) -> dict[str, list[Round]]:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    clients = {c: httpx.AsyncClient(base_url=m.api_url, limits=limits, timeout=httpx.Timeout(600.0, connect=10.0))
               for c, m in meshes.items()}  # fmt: skip
    try:
        models = {c: (await cl.get("/models")).raise_for_status().json()["data"][0]["id"] for c, cl in clients.items()}
        names = list(meshes)
        # Warm-up: connections, lazy initialisation, every instance's first prompt; another
        # system prompt, so that the measured one is first seen in round 0 as by a fresh fleet.
        warm = _prompts(2 * args.concurrency, args.system_tokens, args.user_tokens, vocab, _WARMUP_SEED)
        for c in names:
            await _round(clients[c], models[c], meshes[c], warm, args.max_tokens, args.concurrency)
        prompts = _prompts(args.requests * args.rounds + 1, args.system_tokens, args.user_tokens, vocab, 0)
        first, prompts = prompts[:1], prompts[1:]
        if not args.no_first_request:  # the day's first request: one instance holds the system prompt
            for c in names:
                got = await _round(clients[c], models[c], meshes[c], first, args.max_tokens, 1)
                print(f"# {c}: the first request, alone, went to "
                      f"{[k for k, v in sorted(got.per_instance.items()) if v]} (not counted)")
        rounds: dict[str, list[Round]] = {c: [] for c in names}
        print(f"{'round':>5} {'mesh':<13} {'requests per prefill instance':<30} {'max/even':>8} {'hit rate':>8} "
              f"{'failed':>6} {'TTFT p50 ms':>11}  prefill cached tokens by source")
        for r in range(args.rounds):
            part = prompts[r * args.requests : (r + 1) * args.requests]  # the same prompts for both meshes
            for c in names[r % 2 :] + names[: r % 2]:
                got = await _round(clients[c], models[c], meshes[c], part, args.max_tokens, args.concurrency)
                rounds[c].append(got)
                per = " ".join(str(got.per_instance[k]) for k in sorted(got.per_instance))
                print(f"{r:>5} {c:<13} {per:<30} {got.max_over_even:>8.2f} {got.hit_rate:>8.4f} {got.failed:>6} {got.ttft_p50_ms:>11.0f}  "
                      f"{got.cached_by_source}", flush=True)
        return rounds
    finally:
        for cl in clients.values():
            await cl.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefix_routing_mesh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint folder (default: a tiny one, made)")
    p.add_argument("--prefill", type=int, default=4, help="prefill instances of each mesh (one decode instance)")
    p.add_argument("--requests", type=int, default=48, help="requests per round to each mesh")
    p.add_argument("--rounds", type=int, default=3, help="the two meshes take turns this many times")
    p.add_argument("--concurrency", type=int, default=6, help="requests at once")
    p.add_argument("--system-tokens", type=int, default=1024, help="the system prompt every request shares")
    p.add_argument("--user-tokens", type=int, default=16, help="each request's own tokens after it")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prefix-first-weight", type=float, default=1e9,
                   help="the baseline mesh's balancer.kv_overlap_weight (large: prefix first, as before issue 32)")
    p.add_argument("--no-first-request", action="store_true",
                   help="start round 0 with no instance holding the system prompt (its first requests arrive "
                        "together) rather than after one request of it, sent alone")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=32 << 20,
                   help="each engine's KV cache (ten engines share the machine)")
    p.add_argument("--device", default=None, help="engine device (default: the settings')")
    p.add_argument("--state-dir", default=None, help="keep the meshes' logs here")
    p.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    add_json_flag(p)
    args = p.parse_args(argv)
    if min(args.prefill, args.requests, args.rounds, args.concurrency, args.system_tokens, args.user_tokens,
           args.max_tokens) < 1:  # fmt: skip
        p.error("every count and length must be at least 1")
    flags = {"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    if args.device is not None:
        flags["device"] = args.device
    extra = {"kv cost": {}, "prefix first": {env_name("balancer", "kv_overlap_weight"): repr(args.prefix_first_weight)}}
    with tee_stdout(args.out), bench_state(args.state_dir, "infermesh-prefix-routing-", "the meshes' logs") as state:
        made = args.model is None
        model = model_or_made(args.model, state)
        config, mesh_env = engine_setup(model, flags)
        from transformers import AutoConfig

        vocab = min(AutoConfig.from_pretrained(model).vocab_size, 4096)
        print(f"# model {'tiny (made)' if made else model}, device {config.device}, block size {config.block_size}, "
              f"KV cache {config.kv_cache_memory_bytes >> 20} MiB per engine; {args.prefill} prefill + 1 decode per mesh")
        print(f"# every prompt = the same {args.system_tokens}-token system prompt + {args.user_tokens} own tokens, "
              f"max_tokens {args.max_tokens}; {args.requests} requests per round per mesh, concurrency "
              f"{args.concurrency}; hit-rate ceiling {args.system_tokens / (args.system_tokens + args.user_tokens):.3f}")
        print(f"# kv cost: balancer.kv_overlap_weight default; prefix first: {args.prefix_first_weight:g}; "
              "both meshes up at once, taking turns, order rotated by round; one warm-up round each (another "
              "system prompt) not counted; " + ("no first request" if args.no_first_request else
                                                "then one request of the system prompt alone, not counted"))
        with ExitStack() as stack:  # both meshes stop whatever happens
            meshes: dict[str, Mesh] = {}
            for c, env in extra.items():
                meshes[c] = Mesh(model, args.prefill, 1, free_port(), state / c.replace(" ", "-"),
                                 extra_env={**mesh_env, **env})  # fmt: skip
                stack.callback(meshes[c].stop)
                meshes[c].start()
            rounds = asyncio.run(_measure(meshes, args, vocab))
        print()
        print(f"# over {args.rounds} rounds: median [min - max]")
        for c, rs in rounds.items():
            even = [r.max_over_even for r in rs]
            hit = [r.hit_rate for r in rs]
            total: dict[str, int] = {}
            for r in rs:
                for k, v in r.per_instance.items():
                    total[k] = total.get(k, 0) + v
            print(f"{c:<13} max/even {statistics.median(even):.2f} [{min(even):.2f} - {max(even):.2f}]  "
                  f"hit rate {statistics.median(hit):.4f} [{min(hit):.4f} - {max(hit):.4f}]  "
                  f"requests per instance, all rounds: {' '.join(str(total[k]) for k in sorted(total))}  "
                  f"failed {sum(r.failed for r in rs)}  TTFT p50 ms {statistics.median(r.ttft_p50_ms for r in rs):.0f}")
    rows = [{"routing": c, "round": i, "max_over_even": r.max_over_even, **asdict(r)}
            for c, rs in rounds.items() for i, r in enumerate(rs)]  # fmt: skip
    write_rows(args.json, rows, prefill=args.prefill, requests=args.requests, system_tokens=args.system_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
