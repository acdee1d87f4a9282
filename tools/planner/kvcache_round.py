"""One round of the kvcache load for `infermesh profile`: the rate at which a request's
prefix comes back from the kvcache service as a user gets it, where kvcache holds the
prompt's KV and no engine instance does (after a restart, or once evicted).

A round sends one prompt of `input_tokens` (seeded token ids, a salt of its own, so
nothing holds it) with max_tokens 1, as prefill's rounds do: its TTFT is the uncached
one, and prefill stores its blocks in kvcache. Then the balancer's POST
/reset_prefix_cache makes every prefill and decode instance flush what it writes
behind to kvcache and forget what it keeps (device prefix cache, host tier;
services/balancer/router/prefix_reset.py), and the same prompt is sent again: prefill
loads its full blocks from kvcache and computes the rest. The figures:

ttft_hit_ms       the second request's TTFT (the load, then what is left to compute);
ttft_uncached_ms  the first's, the same prompt computed whole;
gb_s              the prefill workers' kv_transfer_bytes_total{path="kvcache"} over
                  kv_transfer_seconds_total{path="kvcache"}, differenced over the
                  second request (from asking kvcache for the blocks to their arrival
                  in the engine);
bytes_per_token   those bytes over the tokens the workers' cached_tokens_total{source=
                  "kvcache"} grew by: the profile's cross-check against
                  kv_bytes_per_token from the checkpoint's config;
cached_tokens     the response's usage (prompt_tokens_details.cached_tokens).

A round whose second request loaded nothing from kvcache fails, naming why (no prefill
worker's /metrics given, kvcache down, or the worker chose to recompute: a load it
expects to be slower, shared/kv/connectors/load_cost.py); the sweep then says the rate
was not measured. The reset drops every instance's cache: profile a mesh no one else
is using.
"""

from dataclasses import dataclass

import httpx

from tools.planner.mesh_facts import Samples, parse_samples
from tools.planner.points import RoundFailed, request_specs, send_wave

BYTES = "infermesh_prefill_kv_transfer_bytes_total"
SECONDS = "infermesh_prefill_kv_transfer_seconds_total"
TOKENS = "infermesh_prefill_cached_tokens_total"


@dataclass(frozen=True, slots=True)
class KVCacheRound:
    ttft_hit_ms: float
    ttft_uncached_ms: float
    gb_s: float
    bytes_per_token: float
    loaded_bytes: float
    load_s: float
    cached_tokens: int
    wall_s: float


def kvcache_delta(before: Samples, after: Samples, name: str, label: str = "path") -> float:
    """One series' samples with label="kvcache" summed, after less before."""
    def total(samples: Samples) -> float:
        return sum(v for (n, labels), v in samples.items() if n == name and (label, "kvcache") in labels)

    return total(after) - total(before)


def kvcache_figures(ttft_hit_s: float, ttft_uncached_s: float, cached_tokens: int, before: list[Samples],
                    after: list[Samples], wall_s: float) -> KVCacheRound:  # fmt: skip
    """The round's figures from the prefill workers' scrapes around the second request."""
    moved = sum(kvcache_delta(b, a, BYTES) for b, a in zip(before, after))
    took = sum(kvcache_delta(b, a, SECONDS) for b, a in zip(before, after))
    tokens = sum(kvcache_delta(b, a, TOKENS, "source") for b, a in zip(before, after))
    if moved <= 0 or took <= 0:
        raise RoundFailed("the prompt was not loaded from kvcache (kv_transfer_bytes_total{path=\"kvcache\"} did "
                          "not grow on a prefill worker): kvcache down, or the worker recomputed it "
                          "(kvcache_bypassed_total{outcome=\"recompute\"})")
    if tokens <= 0:
        raise RoundFailed("bytes came from kvcache but no prompt token was counted as cached from it")
    return KVCacheRound(ttft_hit_s * 1e3, ttft_uncached_s * 1e3, moved / took / 1e9, moved / tokens, moved, took,
                        cached_tokens, wall_s)


async def reset_prefix_caches(client: httpx.AsyncClient, root: str) -> dict:
    """POST {root}/reset_prefix_cache; its body (what each instance dropped)."""
    resp = await client.post(root + "/reset_prefix_cache")
    if resp.status_code != 200:
        raise RoundFailed(f"POST /reset_prefix_cache answered HTTP {resp.status_code}: {resp.text[:200]}")
    body = resp.json()
    if not body.get("instances"):
        raise RoundFailed("POST /reset_prefix_cache reached no instance")
    return body


async def kvcache_round(client: httpx.AsyncClient, root: str, prefill_metrics: list[str], model: str,
                        input_tokens: int, seed: int, salt: str) -> KVCacheRound:  # fmt: skip
    """client: the balancer's /v1; root: the balancer (…:PORT); prefill_metrics: the
    prefill workers' /metrics (every one: the router picks the instance)."""
    if not prefill_metrics:
        raise RoundFailed("no prefill worker's /metrics given (--metrics-url): the load's bytes are counted there")
    specs = request_specs(input_tokens, 1, 1, seed, salt, {})
    uncached, _, wall_first = await send_wave(client, model, specs)
    await reset_prefix_caches(client, root)
    before = [await _scrape(client, url) for url in prefill_metrics]
    hit, _, wall = await send_wave(client, model, specs)  # the same spec: the same prompt and salt
    after = [await _scrape(client, url) for url in prefill_metrics]
    return kvcache_figures(hit[0].ttft_s, uncached[0].ttft_s, hit[0].num_cached_tokens, before, after,
                           wall_first + wall)


async def _scrape(client: httpx.AsyncClient, url: str) -> Samples:
    return parse_samples((await client.get(url)).raise_for_status().text)
