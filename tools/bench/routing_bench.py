"""`python -m tools.bench.routing_bench`: multi-turn conversations through the mesh,
always disaggregated against conditional disaggregation, side by side in one run.

Two meshes of the same shape (1 prefill, --decode decode instances) run at once:
  disaggregated  every prompt is computed on the prefill instance;
  conditional    a prompt with at most --max-local-tokens left to compute beyond
                 what an instance holds is computed on its decode instance, and the
                 decode instance is chosen by its own cache as well as its load
                 (services/balancer/router/policies.py), so a conversation's next turn goes
                 back to the instance that decoded the last one.
Each is fed the same seeded conversations (tools/bench/workloads.py, multi-turn:
every turn sends the whole history, the server's answers included) by --concurrency
clients, the two taking turns --rounds times so that noise from elsewhere on the
machine falls on both. Printed per configuration: TTFT, output tokens/s, the share of
prompt tokens served from a cache (usage.prompt_tokens_details.cached_tokens) and
where the prompts were computed (the balancer's prefill_site_total); then the
ratios, conditional over disaggregated.
"""

import argparse
import asyncio
from contextlib import ExitStack
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared.runtime.settings import env_name
from tools.bench.mesh_bench import bench_state, engine_setup, model_or_made
from tools.bench.openai_stream import RequestResult
from tools.bench.raw_file import write_json
from tools.bench.serve_bench import LoadLevel, run_level, summarize
from tools.bench.workloads import WorkloadConfig, make_sessions
from tools.launch.up import Mesh, free_port

CONFIGS = ("disaggregated", "conditional")
_WARMUP_SEED = 1_000_003


def _prefill_sites(api_url: str) -> dict[str, float]:
    """The balancer's prefill_site_total by site (local: on decode, remote: on prefill)."""
    text = httpx.get(api_url.removesuffix("/v1") + "/metrics", timeout=10).raise_for_status().text
    sites = {"local": 0.0, "remote": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "infermesh_balancer_prefill_site_total":
                sites[s.labels["site"]] += s.value
    return sites


def figures(results: list[RequestResult], duration_s: float, peak: int, sites: dict[str, float]) -> dict[str, Any]:
    """serve_bench's figures of the configuration's requests, with the cache's share."""
    out = summarize(results, duration_s, peak)
    ok = [r for r in results if r.success]
    prompt = sum(r.num_prompt_tokens for r in ok)
    out["cached_tokens"] = sum(r.num_cached_tokens for r in ok)
    out["cached_share"] = out["cached_tokens"] / prompt if prompt else 0.0
    out["prompts_on_decode"] = int(sites["local"])
    out["prompts_on_prefill"] = int(sites["remote"])
    return out


async def _measure(apis: dict[str, str], workload: WorkloadConfig, conversations: int, concurrency: int,
                   rounds: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    clients = {c: httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0, connect=10.0))
               for c, url in apis.items()}  # fmt: skip
    try:
        models = {c: (await cl.get("/models")).raise_for_status().json()["data"][0]["id"] for c, cl in clients.items()}
        for c in CONFIGS:  # connections, lazy initialisation: never in the figures
            await run_level(clients[c], models[c], make_sessions(workload, 1, seed=_WARMUP_SEED), LoadLevel(1))
        before = {c: _prefill_sites(apis[c]) for c in CONFIGS}
        sessions = make_sessions(workload, conversations, seed=0)  # the same conversations for both
        results: dict[str, list[RequestResult]] = {c: [] for c in CONFIGS}
        duration = dict.fromkeys(CONFIGS, 0.0)
        peak = dict.fromkeys(CONFIGS, 0)
        for r in range(rounds):
            part = sessions[r * conversations // rounds : (r + 1) * conversations // rounds]
            for c in CONFIGS[r % 2 :] + CONFIGS[: r % 2]:
                got, seconds, seen = await run_level(clients[c], models[c], part, LoadLevel(concurrency))
                results[c] += got
                duration[c] += seconds
                peak[c] = max(peak[c], seen)
        out = {}
        for c in CONFIGS:
            after = _prefill_sites(apis[c])
            sites = {k: after[k] - before[c][k] for k in after}
            out[c] = figures(results[c], duration[c], peak[c], sites)
        return out
    finally:
        for cl in clients.values():
            await cl.aclose()


def run_routing_bench(
    model: str | None = None,
    num_decode: int = 2,
    conversations: int = 16,
    turns: int = 4,
    concurrency: int = 4,
    input_len: int = 32,
    output_len: int = 96,
    max_local_tokens: int = 256,
    rounds: int = 2,
    engine_flags: dict[str, Any] | None = None,
    state_dir: str | None = None,
    json_path: str | None = None,
) -> dict[str, Any]:
    """Start both meshes, run the conversations through each, print and return the figures."""
    if min(num_decode, conversations, turns, concurrency, input_len, output_len, max_local_tokens, rounds) < 1:
        raise ValueError("every count and length must be at least 1")
    if rounds > conversations:
        raise ValueError(f"rounds must be at most conversations={conversations}, got {rounds}")
    extra = {
        "disaggregated": {},
        "conditional": {env_name("balancer", "local_prefill_max_tokens"): str(max_local_tokens)},
    }
    workload = WorkloadConfig(name="multi-turn", input_len=input_len, output_len=output_len, turns=turns)
    with bench_state(state_dir, "infermesh-routing-", "the meshes' logs") as state:
        made = model is None
        model = model_or_made(model, state)
        config, mesh_env = engine_setup(model, engine_flags or {})
        run = {"model": None if made else model, "device": config.device, "dtype": config.dtype,
               "num_decode": num_decode, "conversations": conversations, "turns": turns, "concurrency": concurrency,
               "input_len": input_len, "output_len": output_len, "max_local_tokens": max_local_tokens,
               "rounds": rounds}  # fmt: skip
        with ExitStack() as stack:  # both meshes stop whatever happens
            meshes = {}
            for c in CONFIGS:
                meshes[c] = Mesh(model, 1, num_decode, free_port(), state / c, extra_env={**mesh_env, **extra[c]})
                stack.callback(meshes[c].stop)
                meshes[c].start()
            print(" ".join(f"{k}={v if v is not None else 'tiny (made)'}" for k, v in run.items()), flush=True)
            rows = asyncio.run(
                _measure({c: m.api_url for c, m in meshes.items()}, workload, conversations, concurrency, rounds)
            )
    print_table(rows)
    report = {"config": run, "rows": rows, "compare": compare(rows)}
    if json_path:
        write_json(json_path, report)
    return report


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Conditional over disaggregated (below 1 is better for TTFT, above 1 for throughput)."""
    a, b = rows["disaggregated"], rows["conditional"]

    def ratio(key: str) -> float:
        return b[key] / a[key] if a[key] else float("nan")

    return {"ttft_p50": ratio("median_ttft_ms"), "ttft_p90": ratio("p90_ttft_ms"),
            "output_throughput": ratio("output_throughput")}  # fmt: skip


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    header = (f"{'config':<14} | {'done':>4} {'failed':>6} | {'TTFT p50':>8} {'p90 ms':>8} | {'out tok/s':>9} | "
              f"{'cached':>6} | {'on decode':>9} {'on prefill':>10}")  # fmt: skip
    print(header + "\n" + "-" * len(header))
    for c, r in rows.items():
        print(f"{c:<14} | {r['completed']:>4} {r['failed']:>6} | {r['median_ttft_ms']:>8.1f} {r['p90_ttft_ms']:>8.1f} | "
              f"{r['output_throughput']:>9.1f} | {r['cached_share']:>6.0%} | {r['prompts_on_decode']:>9} "
              f"{r['prompts_on_prefill']:>10}")  # fmt: skip
    ratios = compare(rows)
    print(f"conditional / disaggregated: TTFT p50 {ratios['ttft_p50']:.2f}x, p90 {ratios['ttft_p90']:.2f}x, "
          f"output tokens/s {ratios['output_throughput']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.routing_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: a tiny one, made)")
    p.add_argument("--decode", type=int, default=2, help="decode instances of each mesh")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    p.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    p.add_argument("--input-len", type=int, default=32, help="words per user message")
    p.add_argument("--output-len", type=int, default=96, help="max_tokens per answer")
    p.add_argument("--max-local-tokens", type=int, default=256,
                   help="conditional: balancer.local_prefill_max_tokens")
    p.add_argument("--rounds", type=int, default=2, help="the two meshes take turns this many times")
    p.add_argument("--device", default=None, help="engine device (default: the settings')")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the settings')")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache of each engine (default: the settings'); six engines share the device")
    p.add_argument("--state-dir", default=None, help="keep the meshes' logs and traces here")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    given = (("device", a.device), ("dtype", a.dtype), ("kv_cache_memory_bytes", a.kv_cache_memory_bytes))
    flags = {k: v for k, v in given if v is not None}
    run_routing_bench(a.model, a.decode, a.conversations, a.turns, a.concurrency, a.input_len, a.output_len,
                      a.max_local_tokens, a.rounds, flags, a.state_dir, a.json)  # fmt: skip


if __name__ == "__main__":
    main()
