"""`infermesh bench`: load against any OpenAI-compatible endpoint (`--base-url`,
ours or anyone's) and the figures of `vllm bench serve`.

Load, one level after another:
  closed loop  `concurrency` clients, each sending its next request when its last
               one ends;
  open loop    sessions arriving at `request_rate` per second, gaps drawn from a
               gamma distribution of shape `burstiness` (1: Poisson arrivals; below
               1: burstier; inf rate: all at once), at most `max_concurrency` in
               flight when given.
A multi-turn session sends its turns one after another, each after the last answer.

Per level: completed and failed requests, duration, request/output/total token
throughput, goodput (requests/s meeting every SLO given), peak concurrency, and
mean, median, std and percentiles of TTFT, TPOT (per request, after the first
token), ITL (every gap between token chunks) and E2EL, in milliseconds; JSON
and PNG plots (latency CDFs, throughput and latency against load) in `out_dir`.
"""

import asyncio
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tools.bench.openai_stream import RequestResult, send
from tools.bench.raw_file import write_json
from tools.bench.workloads import Session, WorkloadConfig, make_sessions

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class LoadLevel:
    """Closed loop (concurrency) or open loop (request_rate, optionally capped)."""

    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load level is either a concurrency (closed loop) or a request rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"rate {self.request_rate:g}/s"

    @property
    def load(self) -> float:
        """The x of a throughput-against-load plot."""
        return float(self.concurrency if self.concurrency is not None else self.request_rate)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Slo:
    """Goodput's service-level objectives, in milliseconds; None: no limit."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @staticmethod
    def parse(items: list[str]) -> "Slo":
        """From `ttft:500 tpot:50 e2el:2000` (vllm bench serve's --goodput)."""
        limits: dict[str, float] = {}
        for item in items:
            name, _, number = item.partition(":")
            if name not in ("ttft", "tpot", "e2el") or not number:
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
            try:
                limits[f"{name}_ms"] = float(number)
            except ValueError:
                raise ValueError(f"--goodput {name} needs milliseconds, got {number!r}") from None
        return Slo(**limits)

    def met(self, r: RequestResult) -> bool:
        tpot = r.tpot_s or 0.0
        return all(limit is None or value * 1e3 <= limit
                   for limit, value in ((self.ttft_ms, r.ttft_s), (self.tpot_ms, tpot), (self.e2el_ms, r.e2e_s)))

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


# -- the load -------------------------------------------------------------------------


class _InFlight:
    """Requests in flight now, and the most at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def __enter__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


async def _run_session(
    client: httpx.AsyncClient, model: str, session: Session, run_start: float, in_flight: _InFlight
) -> list[RequestResult]:
    answers: list[str] = []
    results = []
    for turn in session.turns:
        with in_flight:
            result = await send(client, model, turn(answers), run_start)
        results.append(result)
        if not result.success:
            break  # later turns need this answer
        answers.append(result.text)
    return results


def arrival_gaps(rate: float, burstiness: float, num: int, seed: int) -> list[float]:
    """Seconds between session arrivals: gamma(shape=burstiness, mean 1/rate); zeros at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num).tolist()


async def run_level(
    client: httpx.AsyncClient, model: str, sessions: list[Session], level: LoadLevel, seed: int = 0
) -> tuple[list[RequestResult], float, int]:
    """(results, duration in seconds, peak concurrency) of one level."""
    in_flight = _InFlight()
    results: list[RequestResult] = []
    start = time.perf_counter()
    if level.concurrency is not None:
        todo: Iterator[Session] = iter(sessions)

        async def user() -> None:
            for session in todo:
                results.extend(await _run_session(client, model, session, start, in_flight))

        await asyncio.gather(*(user() for _ in range(level.concurrency)))
    else:
        assert level.request_rate is not None
        cap = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

        async def arrive(session: Session) -> None:
            if cap is None:
                results.extend(await _run_session(client, model, session, start, in_flight))
                return
            async with cap:
                results.extend(await _run_session(client, model, session, start, in_flight))

        tasks = []
        for session, gap in zip(sessions, arrival_gaps(level.request_rate, level.burstiness, len(sessions), seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(arrive(session)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - start, in_flight.peak


# -- the figures ----------------------------------------------------------------------


def _stats(name: str, values_ms: list[float], percentiles: list[float]) -> dict[str, float]:
    a = np.array(values_ms) if values_ms else np.zeros(1)
    stats = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)), f"std_{name}_ms": float(a.std())}
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    return stats


def summarize(
    results: list[RequestResult], duration_s: float, peak_concurrency: int,
    percentiles: list[float] = [50, 90, 99], slo: Slo = Slo(),  # noqa: B006 (never mutated)
) -> dict[str, Any]:
    """vllm bench serve's figures of one level (latencies in ms; failed requests in no latency)."""
    ok = [r for r in results if r.success]
    num_in = sum(r.num_prompt_tokens for r in ok)
    num_out = sum(r.num_output_tokens for r in ok)
    figures: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_out / duration_s,
        "total_token_throughput": (num_in + num_out) / duration_s,
        "max_concurrency": peak_concurrency,
        "request_goodput": sum(slo.met(r) for r in ok) / duration_s if slo.given else None,
    }
    samples = latency_samples(ok)
    for name in LATENCIES:
        figures |= _stats(name, samples[name], percentiles)
    figures["errors"] = sorted({r.error for r in results if not r.success})[:10]
    return figures


def latency_samples(ok: list[RequestResult]) -> dict[str, list[float]]:
    """Milliseconds, per latency: one per request (TPOT: of those with two tokens or more), ITL one per gap."""
    return {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "tpot": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
        "itl": [gap * 1e3 for r in ok for gap in r.itl_s],
        "e2el": [r.e2e_s * 1e3 for r in ok],
    }


def print_level(level: LoadLevel, f: dict[str, Any], percentiles: list[float]) -> None:
    top = f"p{percentiles[-1]:g}"
    goodput = f"  goodput {f['request_goodput']:.2f} req/s" if f["request_goodput"] is not None else ""
    print(f"{level.label}: {f['completed']} ok, {f['failed']} failed in {f['duration_s']:.2f} s | "
          f"{f['request_throughput']:.2f} req/s, {f['output_throughput']:.1f} out tok/s, "
          f"{f['total_token_throughput']:.1f} tok/s, peak {f['max_concurrency']} in flight{goodput}", flush=True)
    for name in LATENCIES:
        print(f"    {name.upper():<5} mean {f[f'mean_{name}_ms']:>9.2f}  median {f[f'median_{name}_ms']:>9.2f}  "
              f"{top} {f[f'{top}_{name}_ms']:>9.2f} ms", flush=True)
    for error in f["errors"]:
        print(f"    error: {error}", flush=True)


# -- the run ---------------------------------------------------------------------------


def api_base(base_url: str) -> str:
    """The /v1 root: http://host:8000 and http://host:8000/v1 alike."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def _bench(
    base_url: str, model: str | None, api_key: str | None, workload: WorkloadConfig, levels: list[LoadLevel],
    num_sessions: int, percentiles: list[float], slo: Slo, seed: int, num_warmup: int, timeout_s: float,
) -> dict[str, Any]:
    peak = max((lv.concurrency or lv.max_concurrency or num_sessions) for lv in levels) * workload.turns
    limits = httpx.Limits(max_connections=peak, max_keepalive_connections=peak)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=api_base(base_url), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:  # fmt: skip
        if model is None:
            models = (await client.get("/models")).raise_for_status().json()["data"]
            if not models:
                raise ValueError(f"{base_url} serves no model; give --model")
            model = str(models[0]["id"])
        if num_warmup:  # connections, lazy initialisation; never in the figures
            await run_level(client, model, make_sessions(workload, num_warmup, seed=seed + 10_007), LoadLevel(1))
        out = []
        for i, level in enumerate(levels):
            sessions = make_sessions(workload, num_sessions, seed=seed + i)  # fresh prompts per level
            results, duration, peak_seen = await run_level(client, model, sessions, level, seed=seed + i)
            figures = summarize(results, duration, peak_seen, percentiles, slo)
            print_level(level, figures, percentiles)
            out.append({"level": asdict(level), "label": level.label, "load": level.load, "figures": figures,
                        "samples_ms": latency_samples([r for r in results if r.success])})
    return {"model": model, "levels": out}


def run_bench(
    base_url: str,
    levels: list[LoadLevel],
    workload: WorkloadConfig = WorkloadConfig(),
    num_prompts: int = 64,
    model: str | None = None,
    api_key: str | None = None,
    percentiles: list[float] | None = None,
    slo: Slo = Slo(),
    seed: int = 0,
    num_warmup: int = 1,
    timeout_s: float = 600.0,
    out_dir: str | None = None,
) -> dict[str, Any]:
    """Run every level against base_url; return the figures, written with plots to
    out_dir (bench.json, latency_cdf.png, throughput_vs_load.png) when given.
    num_prompts: sessions per level (multi-turn: each sends `turns` requests)."""
    percentiles = sorted(percentiles or [50, 90, 99])
    if not levels:
        raise ValueError("give at least one load level (--concurrency or --request-rate)")
    if num_prompts < 1 or num_warmup < 0 or not all(0 < p < 100 for p in percentiles):
        raise ValueError("num_prompts must be at least 1, num_warmup at least 0, percentiles in (0, 100)")
    run = asyncio.run(_bench(base_url, model, api_key, workload, levels, num_prompts, percentiles, slo, seed,
                             num_warmup, timeout_s))  # fmt: skip
    report = {
        "config": {"base_url": base_url, "model": run["model"], "workload": asdict(workload), "num_prompts": num_prompts,
                   "percentiles": percentiles, "slo": asdict(slo), "seed": seed},
        "levels": run["levels"],
    }  # fmt: skip
    if out_dir is not None:
        from tools.bench.bench_plots import plot_latency_cdfs, plot_throughput_vs_load

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "bench.json", report)
        plot_latency_cdfs(report, out / "latency_cdf.png")
        plot_throughput_vs_load(report, out / "throughput_vs_load.png")
        print(f"figures in {out / 'bench.json'}, plots in {out}", flush=True)
    return report
