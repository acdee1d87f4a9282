"""`infermesh profile`: a bounded sweep of a running mesh, stage by stage, through
its OpenAI API (the balancer) and its Prometheus /metrics, written as a
services/planner/profile.py Profile, a raw file of every round, and a plot.

    infermesh up &                       # or any mesh; then:
    infermesh profile --url http://127.0.0.1:8000 --out profile.json --budget-s 600 \
        --metrics-url http://127.0.0.1:PREFILL_METRICS/metrics --holdout --raw profile.txt

What each point is (tools/planner/points.py), how the budget thins the grid
(tools/planner/grid.py), the accuracy check (tools/planner/holdout.py). Each point
is warmed up (one round, dropped), then measured `rounds` times, the points of a
stage taking turns: its figure is the median of its rounds, whose min-max the raw
file shows. Held-out points (--holdout) take their turns among the grid's. The
mesh is measured as it runs: one instance per stage gives per-instance figures, which the profile is;
with more, the figures are the mesh's (the raw file says how many were live).

Vision (tools/planner/vision_round.py), where the mesh has vision instances and
vision_concurrency is not empty: encode latency and images/s against images in
flight and image size, one square image of each `vision_image_px` per chat, off the
balancer's vision series.

Transfer rates: the workers count the KV bytes they load and the seconds the loads
take (kv_transfer_bytes_total and kv_transfer_seconds_total, by path). In the prefill
and decode rounds (uncached prompts) every load on a decode worker is a prefill ->
decode handoff, so handoff_gb_s is the decode workers' bytes over their seconds over
those rounds, when their /metrics is given (--metrics-url). The kvcache round
(tools/planner/kvcache_round.py), last, where kvcache_lengths is not empty and a prefill
worker's /metrics is given: a prompt computed, every instance's prefix cache reset
(POST /reset_prefix_cache), the prompt sent again and loaded from kvcache;
kvcache_gb_s is the prefill workers' kvcache bytes over their seconds over its timed
rounds, and its points the TTFT of the hit against the same prompt uncached.
kv_bytes_per_token comes from the checkpoint's config (--model-dir, or the model id
when it is a local folder), cross-checked against the bytes the decode workers'
kv_transfer_bytes_total counts for the handoffs and the kvcache round's bytes per
cached token.
"""

import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from services.planner.profile import DecodePoint, KVCachePoint, PrefillPoint, Profile, TransferRates, VisionPoint
from tools.bench.raw_file import commit, run_header, write_text
from tools.bench.rounds import rotation
from tools.planner import holdout
from tools.planner.grid import Budget, estimate_s, grid_order
from tools.planner.kvcache_round import KVCacheRound, kvcache_round
from tools.planner.mesh_facts import (MeshFacts, Samples, device, kv_bytes_per_token, parse_samples, read_facts,
                                      scrape, series_sum, worker_stage)
from tools.planner.points import DecodeRound, PrefillRound, RoundFailed, decode_round, prefill_round
from tools.planner.report import Measured, SweepResult, report_text
from tools.planner.vision_round import VisionRound, vision_round


@dataclass(frozen=True, slots=True)
class SweepConfig:
    url: str
    """The balancer, http://HOST:PORT (a trailing /v1 is dropped)."""
    out: Path
    metrics_urls: tuple[str, ...] = ()
    """Workers' /metrics (the balancer's own is read from url)."""
    budget_s: float = 600.0
    prefill_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    prefill_concurrency: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_max_tokens: int = 64
    vision_concurrency: tuple[int, ...] = (1, 2, 4, 8)
    """Images in flight (one per chat); measured only where the mesh has vision instances; () skips."""
    vision_image_px: tuple[int, ...] | int = (224, 448)
    """The images' sides in pixels (square), one grid axis: the encoder's cost grows with
    its patches. A single int (the older form) is one size."""
    kvcache_lengths: tuple[int, ...] = (512, 2048)
    """Prompt tokens of the kvcache round (tools/planner/kvcache_round.py); () skips it."""
    rounds: int = 3
    holdout: bool = False
    raw: Path | None = None
    plot: bool = True
    model_dir: str | None = None
    device: str | None = None
    api_key: str | None = None
    seed: int = 0
    note: str | None = None
    """Said in the raw file and the profile's settings (how the mesh was started, say)."""

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.budget_s <= 0 or self.decode_max_tokens < 4:
            raise ValueError("rounds must be at least 1, budget_s positive, decode_max_tokens at least 4")
        axes = (self.prefill_lengths, self.prefill_concurrency, self.decode_batches, self.decode_contexts)
        if any(not axis or min(axis) < 1 for axis in axes):
            raise ValueError("every prefill length, concurrency, decode batch and context must be at least 1")
        if isinstance(self.vision_image_px, int):
            object.__setattr__(self, "vision_image_px", (self.vision_image_px,))
        if (self.vision_concurrency and min(self.vision_concurrency) < 1) or not self.vision_image_px \
                or min(self.vision_image_px) < 1:
            raise ValueError("vision concurrency and image sizes must be at least 1")
        if self.kvcache_lengths and min(self.kvcache_lengths) < 2:
            raise ValueError("kvcache lengths must be at least 2 tokens (a block loaded, the last token computed)")

    @property
    def image_sizes(self) -> tuple[int, ...]:
        assert not isinstance(self.vision_image_px, int)  # __post_init__ made it a tuple
        return self.vision_image_px

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


_FIGURES = {"prefill": ("ttft_ms", "tokens_per_s"), "decode": ("itl_ms", "tokens_per_s"),
            "vision": ("latency_ms", "images_per_s"), "kvcache": ("ttft_hit_ms", "ttft_uncached_ms", "gb_s")}
_AXES = {"prefill": "(input_tokens, concurrency)", "decode": "(batch, context_tokens)",
         "vision": "(concurrency, image_px)", "kvcache": "(input_tokens, concurrency)"}
Point = tuple[int, int]


class _Sweep:
    """The measuring loop of one run; holds its client, clock and what it measured."""

    def __init__(self, config: SweepConfig, client: httpx.AsyncClient, model: str, budget: Budget) -> None:
        self.config, self.client, self.model, self.budget = config, client, model, budget
        self.measured: list[Measured] = []
        self.skipped: list[tuple[str, tuple[int, int]]] = []
        self._costs: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": [], "vision": [], "kvcache": []}
        self.prefill_metrics: list[str] = []
        """The prefill workers' /metrics (the kvcache round counts its loads there)."""
        self._num_rounds_run = 0
        self.handoffs: list[tuple[int, int]] = []
        """(prompt tokens, streams) of every decode wave sent (warm-ups and resent rounds too)."""

    def _work(self, stage: str, point: tuple[int, int]) -> float:
        if stage == "prefill":
            return point[0] * point[1]
        if stage == "vision":
            return point[0] * point[1] ** 2 / 256  # images x pixels, on the scale of prompt tokens (any scale does)
        if stage == "kvcache":
            return 2 * point[0]  # the prompt computed, then loaded and its last block computed
        batch, context = point
        return batch * context + batch * self.config.decode_max_tokens * 16  # a decode step ~ 16 prompt tokens' time

    async def _round(self, stage: str, point: Point) -> PrefillRound | DecodeRound | VisionRound | KVCacheRound:
        self._num_rounds_run += 1
        seed, salt = self.config.seed * 1_000_003 + self._num_rounds_run, f"profile-{os.getpid()}-{time.time_ns()}"
        if stage == "prefill":
            return await prefill_round(self.client, self.model, point[0], point[1], seed, salt)
        if stage == "vision":
            return await vision_round(self.client, self.config.root + "/metrics", self.model, point[0], point[1],
                                      seed, salt)  # fmt: skip
        if stage == "kvcache":
            return await kvcache_round(self.client, self.config.root, self.prefill_metrics, self.model, point[0],
                                       seed, salt)  # fmt: skip
        r = await decode_round(self.client, self.model, point[0], point[1], self.config.decode_max_tokens, seed, salt)
        self.handoffs += [(prompt, point[0]) for prompt in r.wave_prompts]
        return r

    async def stage(self, stage: str, grid: Sequence[Point], held: Sequence[Point]) -> None:
        """Warm up each point, coarse to fine, while its rounds fit the stage's time
        (the warm-up's own time is what the later points' estimates learn from); then
        the timed rounds, every kept point once a round, round r starting at point r
        mod n (tools/bench/rounds.py's rotation), so a burst of load from elsewhere
        on the machine falls on each point in turn, held-out points among them."""
        kept: list[tuple[Point, bool]] = []
        committed_s = 0.0  # the timed rounds of the points kept so far, estimated
        for point, held_out in [*((p, False) for p in grid), *((p, True) for p in held)]:
            work = self._work(stage, point)
            if not self.budget.fits(stage, committed_s + estimate_s(work, self._costs[stage], self.config.rounds)):
                self.skipped.append((stage, point))
                print(f"  {stage} {point}: skipped (budget)", flush=True)
                continue
            warm = await self._round(stage, point)  # a shape seen for the first time pays for it
            self._costs[stage].append((work, warm.wall_s))
            committed_s += self.config.rounds * warm.wall_s
            kept.append((point, held_out))
        rounds: dict[Point, list[dict[str, float]]] = {p: [] for p, _ in kept}
        for r in range(self.config.rounds):
            for point, _ in rotation(kept, r):
                rounds[point].append(asdict(await self._round(stage, point)))
        for point, held_out in kept:
            m = Measured(stage, point, rounds[point], held_out)
            self.measured.append(m)
            figs = ", ".join(f"{n} {m.median(n):.1f}" for n in _FIGURES[stage])
            print(f"  {stage} {point}{' (held out)' if held_out else ''}: {figs}", flush=True)


def _grid(measured: Sequence[Measured], stage: str) -> dict[tuple[int, int], dict[str, float]]:
    return {m.point: {n: m.median(n) for n in _FIGURES[stage]} for m in measured if m.stage == stage and not m.held_out}


def _stages(config: SweepConfig, facts: MeshFacts, workers: dict[str, Samples]) -> tuple[str, ...]:
    """prefill and decode; vision where the mesh has vision instances and the config asks
    for it; kvcache (last: it resets every instance's cache) where the config asks for it
    and a prefill worker's /metrics is given."""
    vision = ("vision",) if facts.instances.get("vision") and config.vision_concurrency else ()
    kvcache = ("kvcache",) if config.kvcache_lengths and _prefill_metrics(workers) else ()
    return ("prefill", "decode") + vision + kvcache


def _prefill_metrics(workers: dict[str, Samples]) -> list[str]:
    return [url for url, samples in workers.items() if worker_stage(samples) == "prefill"]


async def _run(config: SweepConfig, facts: MeshFacts, budget: Budget, prefill_metrics: list[str],
               notes: dict[str, Any]) -> tuple[_Sweep, list, dict[str, Samples]]:  # fmt: skip
    """The stages in order; returns the sweep, the held-out checks, and the workers'
    scrapes as the decode stage ended (the handoffs' counters: the kvcache round after
    it moves none, but its resets are no handoffs either)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    conc = max(*config.prefill_concurrency, *config.decode_batches, *config.vision_concurrency)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=config.root + "/v1", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600.0, connect=10.0)) as client:  # fmt: skip
        sweep = _Sweep(config, client, facts.model, budget)
        sweep.prefill_metrics = prefill_metrics
        axes = {"prefill": (config.prefill_lengths, config.prefill_concurrency),
                "decode": (config.decode_batches, config.decode_contexts),
                "vision": (config.vision_concurrency, config.image_sizes),
                "kvcache": (config.kvcache_lengths, (1,))}  # fmt: skip
        checks: list[tuple[str, holdout.Check]] = []
        after_decode: dict[str, Samples] = {}
        for stage in budget.parts:
            if stage == "kvcache":  # the handoffs' counters end here
                after_decode = {u: await _scrape_async(client, u) for u in config.metrics_urls}
            xs, ys = axes[stage]
            print(f"{stage} {_AXES[stage]}:", flush=True)
            # The vision grid is held out of the check (its sizes are few; the encoder's curve is the grid's);
            # kvcache's figures are rates and pairs, not a curve the planner interpolates.
            held = holdout.held_out_points(xs, ys) if config.holdout and stage in ("prefill", "decode") else []
            try:
                await sweep.stage(stage, grid_order(xs, ys), held)
            except RoundFailed as exc:
                if stage != "kvcache":
                    raise
                notes["kvcache"] = f"not measured: {exc}"  # the other stages' figures stand
                print(f"  kvcache: {exc}", flush=True)
                continue
            measured = {m.point: {n: m.median(n) for n in _FIGURES[stage]}
                        for m in sweep.measured if m.stage == stage and m.held_out}  # fmt: skip
            predict = holdout.grid_predictor(_grid(sweep.measured, stage))
            checks += [(stage, c) for c in holdout.checks(measured, predict)]
        return sweep, checks, after_decode


async def _scrape_async(client: httpx.AsyncClient, url: str) -> Samples:
    return parse_samples((await client.get(url)).raise_for_status().text)


def _load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def run_sweep(config: SweepConfig) -> SweepResult:
    """Measure the mesh at config.url; write config.out (the Profile), config.raw (every
    round, the held-out checks) and the plot beside config.out."""
    header = run_header()  # as the run starts: the commit and the tree that ran
    worker_urls = list(config.metrics_urls)
    with httpx.Client(base_url=config.root, timeout=30) as api:
        before = {u: scrape(u) for u in worker_urls}
        facts = read_facts(api, before)
    budget = Budget(config.budget_s, _stages(config, facts, before))
    notes: dict[str, Any] = {"note": config.note} if config.note else {}
    notes["load_average_before"] = _load_average()
    print(f"profiling {facts.model} at {config.root}: instances {facts.instances}, budget {config.budget_s:g} s",
          flush=True)
    sweep, checks, after_decode = asyncio.run(_run(config, facts, budget, _prefill_metrics(before), notes))
    notes["load_average_after"] = _load_average()
    notes["elapsed_s"] = round(time.monotonic() - budget.start, 1)
    after = after_decode or {u: scrape(u) for u in worker_urls}
    kv_per_token = kv_bytes_per_token(config.model_dir or facts.model, facts.cache_dtype)
    notes["kv_bytes_per_token_from_config"] = kv_per_token
    notes["kv_bytes_per_token_from_metrics"] = _kv_bytes_measured(sweep, facts.block_size, before, after)
    handoff = _handoff_gb_s(before, after)
    kvcache = _kvcache_gb_s(sweep.measured)
    if kvcache is not None:
        notes["kv_bytes_per_token_from_kvcache"] = round(statistics.median(
            r["bytes_per_token"] for m in sweep.measured if m.stage == "kvcache" for r in m.rounds))
    elif "kvcache" not in notes:
        notes["kvcache"] = "not measured: " + ("no kvcache length asked for" if not config.kvcache_lengths else
                                               "no prefill worker's /metrics given (--metrics-url)"
                                               if not _prefill_metrics(before) else "the budget left no point")
    notes["transfer"] = ("kvcache_gb_s: " + (f"{kvcache:.3f}" if kvcache else "not measured")
                         + "; handoff_gb_s: " + (f"{handoff:.3f}" if handoff else "not measured (no decode worker's "
                                                 "/metrics given, or it loaded nothing)"))  # fmt: skip
    if "vision" not in budget.parts:
        notes["vision"] = ("not measured: " + ("the mesh has no vision instance" if not facts.instances.get("vision")
                                               else "no vision concurrency asked for"))
    profile = _profile(config, facts, sweep, header["command"],
                       kv_per_token or notes["kv_bytes_per_token_from_metrics"], handoff, kvcache)  # fmt: skip
    result = SweepResult(profile, sweep.measured, sweep.skipped, checks, notes)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(config.out)
    text = report_text(result, {**header, "device": profile.device})
    print(text)
    if config.raw is not None:
        write_text(config.raw, text, {**header, "device": profile.device})
    if config.plot:
        from tools.planner.profile_plot import plot_profile

        print(f"plot: {plot_profile(profile, config.out.with_suffix(''))}")
    return result


def _kv_bytes_measured(sweep: _Sweep, block_size: int | None, before: dict, after: dict) -> int | None:
    """The decode workers' kv_transfer_bytes_total over the sweep (every load: in a
    sweep of uncached prompts, the prefill -> decode handoffs), per prompt token the
    decode waves handed off in full blocks (a prompt's last, partial block is not
    handed off). Prefill-only rounds (max_tokens 1) hand nothing off."""
    moved = sum(series_sum(after[u], _DECODE_BYTES) - series_sum(before[u], _DECODE_BYTES) for u in before)
    if block_size is None:
        return None
    tokens = sum(prompt // block_size * block_size * streams for prompt, streams in sweep.handoffs)
    return round(moved / tokens) if moved > 0 and tokens else None


def _handoff_gb_s(before: dict, after: dict) -> float | None:
    """The decode workers' KV bytes loaded over the seconds the loads took, in GB/s
    (every load a handoff in a sweep of uncached prompts); None with none timed."""
    moved = sum(series_sum(after[u], _DECODE_BYTES) - series_sum(before[u], _DECODE_BYTES) for u in before)
    took = sum(series_sum(after[u], _DECODE_SECONDS) - series_sum(before[u], _DECODE_SECONDS) for u in before)
    return moved / took / 1e9 if moved > 0 and took > 0 else None


def _kvcache_gb_s(measured: Sequence[Measured]) -> float | None:
    """The kvcache round's bytes over its load seconds, every timed round of every
    point together (as handoff_gb_s is); None where none was measured."""
    rounds = [r for m in measured if m.stage == "kvcache" for r in m.rounds]
    took = sum(r["load_s"] for r in rounds)
    return sum(r["loaded_bytes"] for r in rounds) / took / 1e9 if took > 0 else None


_DECODE_BYTES = "infermesh_decode_kv_transfer_bytes_total"
_DECODE_SECONDS = "infermesh_decode_kv_transfer_seconds_total"


def _profile(config: SweepConfig, facts: MeshFacts, sweep: _Sweep, command: str, kv_per_token: int | None,
             handoff_gb_s: float | None = None, kvcache_gb_s: float | None = None) -> Profile:  # fmt: skip
    grid = sorted((m for m in sweep.measured if not m.held_out), key=lambda m: m.point)
    settings = {
        **facts.settings,
        "sweep.rounds": str(config.rounds), "sweep.budget_s": f"{config.budget_s:g}",
        "sweep.decode_max_tokens": str(config.decode_max_tokens),
        **({"sweep.vision_image_px": ",".join(map(str, config.image_sizes))}
           if any(m.stage == "vision" for m in grid) else {}),
        **({"note": config.note} if config.note else {}),
        **{k: v for k, v in sorted(os.environ.items()) if k.startswith("INFERMESH_")},
    }  # fmt: skip
    return Profile(
        model=facts.model, device=config.device or device(), commit=commit(), command=command,
        created_unix=time.time(), settings=settings,
        prefill=[PrefillPoint(m.point[0], m.point[1], m.median("ttft_ms"), m.median("tokens_per_s"))
                 for m in grid if m.stage == "prefill"],
        decode=[DecodePoint(m.point[0], m.point[1], m.median("itl_ms"), m.median("tokens_per_s"))
                for m in grid if m.stage == "decode"],
        vision=[VisionPoint(m.point[0], m.median("images_per_s"), m.median("latency_ms"), m.point[1])
                for m in grid if m.stage == "vision"],
        kvcache=[KVCachePoint(m.point[0], m.median("ttft_hit_ms"), m.median("ttft_uncached_ms"), m.median("gb_s"))
                 for m in grid if m.stage == "kvcache"],
        transfer=TransferRates(kvcache_gb_s=kvcache_gb_s, kv_bytes_per_token=kv_per_token, handoff_gb_s=handoff_gb_s),
    )  # fmt: skip
