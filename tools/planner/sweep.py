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
flight, one image of `vision_image_px` square per chat, off the balancer's vision
series.

Transfer rates: the workers count the KV bytes they load and the seconds the loads
take (kv_transfer_bytes_total and kv_transfer_seconds_total, by path). In a sweep of
uncached prompts every load on a decode worker is a prefill -> decode handoff, so
handoff_gb_s is the decode workers' bytes over their seconds, when their /metrics is
given (--metrics-url); kvcache_gb_s stays None (no round here loads from kvcache:
every prompt is salted). kv_bytes_per_token comes from the checkpoint's config
(--model-dir, or the model id when it is a local folder), cross-checked against the
bytes the decode workers' kv_transfer_bytes_total counts for the handoffs.
"""

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from services.planner.profile import DecodePoint, PrefillPoint, Profile, TransferRates, VisionPoint
from tools.bench.raw_file import commit, run_header, write_text
from tools.bench.rounds import rotation
from tools.planner import holdout
from tools.planner.grid import Budget, estimate_s, grid_order
from tools.planner.mesh_facts import MeshFacts, device, kv_bytes_per_token, read_facts, scrape, series_sum
from tools.planner.points import DecodeRound, PrefillRound, decode_round, prefill_round
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
    vision_image_px: int = 224
    """Each image's side in pixels (square): the encoder's cost grows with its patches."""
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
        if (self.vision_concurrency and min(self.vision_concurrency) < 1) or self.vision_image_px < 1:
            raise ValueError("vision concurrency and image size must be at least 1")

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


_FIGURES = {"prefill": ("ttft_ms", "tokens_per_s"), "decode": ("itl_ms", "tokens_per_s"),
            "vision": ("latency_ms", "images_per_s")}
_AXES = {"prefill": "(input_tokens, concurrency)", "decode": "(batch, context_tokens)",
         "vision": "(concurrency, image_px)"}
Point = tuple[int, int]


class _Sweep:
    """The measuring loop of one run; holds its client, clock and what it measured."""

    def __init__(self, config: SweepConfig, client: httpx.AsyncClient, model: str, budget: Budget) -> None:
        self.config, self.client, self.model, self.budget = config, client, model, budget
        self.measured: list[Measured] = []
        self.skipped: list[tuple[str, tuple[int, int]]] = []
        self._costs: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": [], "vision": []}
        self._num_rounds_run = 0
        self.handoffs: list[tuple[int, int]] = []
        """(prompt tokens, streams) of every decode wave sent (warm-ups and resent rounds too)."""

    def _work(self, stage: str, point: tuple[int, int]) -> float:
        if stage == "prefill":
            return point[0] * point[1]
        if stage == "vision":
            return point[0] * point[1] ** 2 / 256  # images x pixels, on the scale of prompt tokens (any scale does)
        batch, context = point
        return batch * context + batch * self.config.decode_max_tokens * 16  # a decode step ~ 16 prompt tokens' time

    async def _round(self, stage: str, point: tuple[int, int]) -> PrefillRound | DecodeRound | VisionRound:
        self._num_rounds_run += 1
        seed, salt = self.config.seed * 1_000_003 + self._num_rounds_run, f"profile-{os.getpid()}-{time.time_ns()}"
        if stage == "prefill":
            return await prefill_round(self.client, self.model, point[0], point[1], seed, salt)
        if stage == "vision":
            return await vision_round(self.client, self.config.root + "/metrics", self.model, point[0], point[1],
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


def _stages(config: SweepConfig, facts: MeshFacts) -> tuple[str, ...]:
    """prefill and decode; vision where the mesh has vision instances and the config asks for it."""
    return ("prefill", "decode") + (("vision",) if facts.instances.get("vision") and config.vision_concurrency else ())


async def _run(config: SweepConfig, facts: MeshFacts, budget: Budget) -> tuple[_Sweep, list]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    conc = max(*config.prefill_concurrency, *config.decode_batches, *config.vision_concurrency)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=config.root + "/v1", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600.0, connect=10.0)) as client:  # fmt: skip
        sweep = _Sweep(config, client, facts.model, budget)
        axes = {"prefill": (config.prefill_lengths, config.prefill_concurrency),
                "decode": (config.decode_batches, config.decode_contexts),
                "vision": (config.vision_concurrency, (config.vision_image_px,))}  # fmt: skip
        checks: list[tuple[str, holdout.Check]] = []
        for stage in budget.parts:
            xs, ys = axes[stage]
            print(f"{stage} {_AXES[stage]}:", flush=True)
            # One image size: no second axis to hold a point out between (the encoder's curve is the grid's).
            held = holdout.held_out_points(xs, ys) if config.holdout and stage != "vision" else []
            await sweep.stage(stage, grid_order(xs, ys), held)
            measured = {m.point: {n: m.median(n) for n in _FIGURES[stage]}
                        for m in sweep.measured if m.stage == stage and m.held_out}  # fmt: skip
            predict = holdout.grid_predictor(_grid(sweep.measured, stage))
            checks += [(stage, c) for c in holdout.checks(measured, predict)]
        return sweep, checks


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
    budget = Budget(config.budget_s, _stages(config, facts))
    notes: dict[str, Any] = {"note": config.note} if config.note else {}
    notes["load_average_before"] = _load_average()
    print(f"profiling {facts.model} at {config.root}: instances {facts.instances}, budget {config.budget_s:g} s",
          flush=True)
    sweep, checks = asyncio.run(_run(config, facts, budget))
    notes["load_average_after"] = _load_average()
    notes["elapsed_s"] = round(time.monotonic() - budget.start, 1)
    after = {u: scrape(u) for u in worker_urls}
    kv_per_token = kv_bytes_per_token(config.model_dir or facts.model, facts.cache_dtype)
    notes["kv_bytes_per_token_from_config"] = kv_per_token
    notes["kv_bytes_per_token_from_metrics"] = _kv_bytes_measured(sweep, facts.block_size, before, after)
    handoff = _handoff_gb_s(before, after)
    notes["transfer"] = ("kvcache_gb_s: not measured (no round loads from kvcache); handoff_gb_s: "
                         + (f"{handoff:.3f}" if handoff else "not measured (no decode worker's /metrics given, "
                            "or it loaded nothing)"))  # fmt: skip
    if "vision" not in budget.parts:
        notes["vision"] = ("not measured: " + ("the mesh has no vision instance" if not facts.instances.get("vision")
                                               else "no vision concurrency asked for"))
    profile = _profile(config, facts, sweep, header["command"],
                       kv_per_token or notes["kv_bytes_per_token_from_metrics"], handoff)  # fmt: skip
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


_DECODE_BYTES = "infermesh_decode_kv_transfer_bytes_total"
_DECODE_SECONDS = "infermesh_decode_kv_transfer_seconds_total"


def _profile(config: SweepConfig, facts: MeshFacts, sweep: _Sweep, command: str, kv_per_token: int | None,
             handoff_gb_s: float | None = None) -> Profile:  # fmt: skip
    grid = sorted((m for m in sweep.measured if not m.held_out), key=lambda m: m.point)
    settings = {
        **facts.settings,
        "sweep.rounds": str(config.rounds), "sweep.budget_s": f"{config.budget_s:g}",
        "sweep.decode_max_tokens": str(config.decode_max_tokens),
        **({"sweep.vision_image_px": str(config.vision_image_px)} if any(m.stage == "vision" for m in grid) else {}),
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
        vision=[VisionPoint(m.point[0], m.median("images_per_s"), m.median("latency_ms"))
                for m in grid if m.stage == "vision"],
        transfer=TransferRates(kv_bytes_per_token=kv_per_token, handoff_gb_s=handoff_gb_s),
    )  # fmt: skip
