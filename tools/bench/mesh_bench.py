"""`infermesh bench-mesh`: throughput and latency through the mesh against the
engine in one process, on the same model, prompts and settings, side by side in
one run, so the ratios and differences hold on a noisy machine.

Three targets, each fed the same prompts in a closed loop of `concurrency` clients:
  engine  LLMEngine stepped directly in this process (no queues, no HTTP), on a
          thread as in the services;
  http    the balancer's OpenAI API over that engine in one process (LocalGenerator
          behind uvicorn, in a child process), which separates the cost of HTTP/SSE
          and detokenization from the cost of the mesh;
  mesh    `Mesh`: nats-server, kvcache, prefill and decode instances and the balancer
          as real processes, as `infermesh up` starts them.
HTTP requests stream token-id prompts through /v1/completions with `logprobs: 0`:
the balancer sends a chunk only when it has text or logprobs, so logprobs make one
entry per token and let the client count tokens, not chunks, and stamp the first
token exactly. Every target samples with the same SamplingParams, logprobs included.
The HTTP targets are measured by `infermesh bench`'s code (tools/bench/serve_bench.py:
the closed loop; tools/bench/openai_stream.py: one streamed request).

How the runs are scheduled and the figures taken (warm-up, dropped round, rotation,
spread, the headline against `http`) is tools/bench/rounds.py; the printed report is
tools/bench/mesh_report.py; the raw files' header is tools/bench/raw_file.py.
"""

import asyncio
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from shared.engine.engine_request import EngineRequest
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.runtime.settings import env_name, load_settings
from tools.bench.local_server import LocalServer
from tools.bench.mesh_report import print_headline, print_progress, print_targets
from tools.bench.mesh_traces import level_breakdowns, print_breakdowns
from tools.bench.openai_stream import RequestSpec
from tools.bench.raw_file import run_header, tee_stdout, write_json
from tools.bench.rounds import MIN_TIMED_ROUNDS, Run, level_figures, plan
from tools.bench.serve_bench import LoadLevel, run_level
from tools.bench.workloads import Session
from tools.launch.up import Mesh, free_port

TARGETS = ("engine", "http", "mesh")
_LEGEND = {
    "engine": "LLMEngine stepped directly in this process",
    "http": "OpenAI API over the engine in one process (LocalGenerator + uvicorn)",
    "mesh": "OpenAI API through the mesh",
}


@dataclass(slots=True)
class Timing:
    """One request, in seconds from its submission."""

    ttft_s: float
    e2e_s: float
    """To its last token."""
    num_tokens: int
    """Output tokens counted as they arrived."""
    num_usage_tokens: int
    """Output tokens as the server's usage reports them (the engine: counted)."""
    num_cached_tokens: int


def _prompts(num: int, prompt_len: int, vocab: int, seed: tuple[int, int]) -> list[list[int]]:
    # Distinct random prompts: no prefix-cache hit flatters any target.
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab, size=(num, prompt_len)).tolist()


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=0)


# -- the targets -----------------------------------------------------------------------


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[Timing], float]:
    """Closed loop over the engine: a new request is added between steps as soon
    as one finishes; a token counts as arrived when the step returns it."""
    params = _params(output_len)
    tag = f"bench-{time.monotonic_ns()}"
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    timings: list[Timing] = []
    next_i = 0
    start = time.perf_counter()
    while next_i < len(prompts) or engine.has_unfinished_requests():
        while next_i < len(prompts) and len(submitted) < concurrency:
            rid = f"{tag}-{next_i}"
            submitted[rid] = time.perf_counter()
            engine.add_request(EngineRequest(rid, prompts[next_i], params))
            counts[rid] = 0
            next_i += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids and rid not in first:
                first[rid] = now
            counts[rid] += len(out.new_token_ids)
            if out.finished:
                t0 = submitted.pop(rid)
                n = counts.pop(rid)
                timings.append(Timing(first.pop(rid) - t0, now - t0, n, n, out.num_cached_tokens))
    return timings, time.perf_counter() - start


async def run_http(
    client: httpx.AsyncClient, model: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[Timing], float]:
    """Closed loop of `concurrency` clients, each sending its next request when the last ends."""
    # The same settings as _params.
    body = {"temperature": 0, "ignore_eos": True, "logprobs": 0}
    specs = [RequestSpec(prompt=p, max_tokens=output_len, num_prompt_tokens=len(p), extra_body=body) for p in prompts]
    sessions = [Session([lambda answers, spec=spec: spec]) for spec in specs]
    results, wall, _ = await run_level(client, model, sessions, LoadLevel(concurrency=concurrency))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed, e.g. {failed[0]}")
    # Latencies end at the last token, as for the engine (not at the usage chunk or [DONE]).
    timings = [Timing(r.ttft_s, r.e2e_s, r.num_counted_tokens, -1 if r.num_usage_tokens is None else r.num_usage_tokens,
                      r.num_cached_tokens) for r in results]  # fmt: skip
    return timings, wall


# -- figures -----------------------------------------------------------------------------


def summarize(timings: list[Timing], wall_s: float) -> dict[str, Any]:
    ttft = np.array([t.ttft_s for t in timings]) * 1e3
    e2e = np.array([t.e2e_s for t in timings]) * 1e3
    # Time per output token after the first (vLLM's TPOT), per request.
    tpot = np.array([(t.e2e_s - t.ttft_s) / (t.num_tokens - 1) for t in timings if t.num_tokens > 1]) * 1e3
    num_out = sum(t.num_tokens for t in timings)
    return {
        "num_completed": len(timings),
        "output_tokens": [t.num_tokens for t in timings],
        "usage_tokens": [t.num_usage_tokens for t in timings],
        "cached_tokens": sum(t.num_cached_tokens for t in timings),
        "wall_s": wall_s,
        "req_s": len(timings) / wall_s,
        "out_tok_s": num_out / wall_s,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "tpot_p50_ms": float(np.percentile(tpot, 50)) if tpot.size else float("nan"),
        "e2e_p50_ms": float(np.percentile(e2e, 50)),
    }


# -- the run -----------------------------------------------------------------------------


@contextmanager
def bench_state(state_dir: str | None, prefix: str, what: str) -> Iterator[Path]:
    """The folder of a bench's logs, traces and made model: state_dir, kept, or a
    temporary one, removed once the bench has run. On a failure it is kept and its
    place printed (what: whose logs it holds)."""
    state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix=prefix))
    state.mkdir(parents=True, exist_ok=True)
    try:
        yield state
    except BaseException:
        print(f"infermesh: {what} are kept in {state}", file=sys.stderr)
        raise
    if state_dir is None:
        shutil.rmtree(state, ignore_errors=True)


def model_or_made(model: str | None, state: Path) -> str:
    """The checkpoint to bench: model, or a tiny one made in the state folder."""
    if model is not None:
        return model
    from tools.make_model import make_model

    made = str(state / "model")
    make_model(made)
    return made


def engine_setup(
    model: str, engine_flags: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> tuple[EngineConfig, dict[str, str]]:
    """One engine configuration for every target, the one the mesh's workers will
    read: the settings (defaults, INFERMESH_CONFIG, this environment's
    INFERMESH_ENGINE__*) with the model and the knobs given on the command line
    over them. The mesh's processes inherit this environment, so the variables
    returned for them carry only what was given explicitly."""
    explicit = {"model": model, **engine_flags}
    config = dataclasses.replace(load_settings(env=env).engine, **explicit)
    return config, {env_name("engine", name): str(value) for name, value in explicit.items()}


async def _measure(
    engine: LLMEngine | None,
    apis: dict[str, str],
    vocab: int,
    runs: list[Run],
    prompt_len: int,
    output_len: int,
) -> list[dict[str, Any]]:
    """Every run of the plan, in its order; the figures per level (rounds.level_figures)."""
    concurrency = max(r.concurrency for r in runs)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(300.0, connect=10.0)
    clients = {t: httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) for t, url in apis.items()}
    try:
        models = {t: (await c.get("/models")).raise_for_status().json()["data"][0]["id"] for t, c in clients.items()}

        async def run(target: str, prompts: list[list[int]], conc: int) -> tuple[list[Timing], float]:
            if target == "engine":
                assert engine is not None
                # Stepped on a thread, as the services step theirs (AsyncEngine): torch's
                # intra-op threading is not the same on the main thread as on others.
                return await asyncio.to_thread(run_engine, engine, prompts, output_len, conc)
            return await run_http(clients[target], models[target], prompts, output_len, conc)

        by_level: dict[int, list[tuple[Run, dict[str, Any]]]] = {}
        mesh_windows: dict[int, list[tuple[int, int]]] = {}  # when the mesh's timed rounds ran (its traces' requests)
        for r in runs:
            started_ns = time.time_ns()
            got, wall = await run(r.target, _prompts(r.num_requests, prompt_len, vocab, r.seed), r.concurrency)
            if r.target == "mesh" and r.timed:
                mesh_windows.setdefault(r.level, []).append((started_ns, time.time_ns()))
            row = summarize(got, wall)
            print_progress(r, row)
            by_level.setdefault(r.level, []).append((r, row))
        return [
            {**level_figures(results), "mesh_windows": mesh_windows.get(level, [])}
            for level, results in sorted(by_level.items())
        ]
    finally:
        for c in clients.values():
            await c.aclose()


def run_mesh_bench(
    model: str | None,
    concurrency: list[int],
    num_requests: int | list[int],
    prompt_len: int,
    output_len: int,
    num_rounds: int = MIN_TIMED_ROUNDS,
    num_prefill: int = 1,
    num_decode: int = 1,
    targets: tuple[str, ...] = TARGETS,
    engine_flags: Mapping[str, Any] | None = None,
    state_dir: str | None = None,
    json_path: str | None = None,
    log_path: str | None = None,
    pid_namespaces: bool = False,
) -> dict[str, Any]:
    """Start the targets, measure each concurrency level on each, print the report
    and return the figures. The mesh and the local server are always stopped.
    num_requests: per target and round, one count for every level or one per level;
    num_rounds: timed rounds (a warm-up and a dropped round come first).
    engine_flags: EngineConfig fields over the settings (see engine_setup).
    json_path, log_path: raw files (the figures; what is printed), under raw_file's header."""
    if output_len < 2:
        raise ValueError("output_len must be at least 2 to time tokens after the first")
    counts = [num_requests] * len(concurrency) if isinstance(num_requests, int) else list(num_requests)
    if len(counts) != len(concurrency):
        raise ValueError(f"give one num_requests or one per concurrency level ({len(concurrency)}), got {len(counts)}")
    if min(counts, default=0) < 1 or prompt_len < 1 or not concurrency or min(concurrency) < 1:
        raise ValueError("num_requests, prompt_len and every concurrency must be at least 1")
    if not targets or set(targets) - set(TARGETS):
        raise ValueError(f"targets must be among {', '.join(TARGETS)}, got {targets}")
    targets = tuple(t for t in TARGETS if t in targets)  # one order, whatever the command line's
    runs = plan(targets, concurrency, counts, num_rounds)  # refuses fewer than MIN_TIMED_ROUNDS
    header = run_header()  # as the run starts: the commit and the tree that ran
    with tee_stdout(log_path, header):
        figures = _bench(model, runs, counts, prompt_len, output_len, num_rounds, num_prefill, num_decode, targets,
                         engine_flags or {}, state_dir, pid_namespaces)  # fmt: skip
    if json_path:
        write_json(json_path, figures, header)
    return figures


def _bench(
    model: str | None,
    runs: list[Run],
    counts: list[int],
    prompt_len: int,
    output_len: int,
    num_rounds: int,
    num_prefill: int,
    num_decode: int,
    targets: tuple[str, ...],
    engine_flags: Mapping[str, Any],
    state_dir: str | None,
    pid_namespaces: bool = False,
) -> dict[str, Any]:
    from shared.model.config import ModelConfig

    with bench_state(state_dir, "infermesh-bench-", "logs of the mesh and the local server") as state:
        made = model is None
        model = model_or_made(model, state)
        config, mesh_env = engine_setup(model, engine_flags)
        run = {
            "model": None if made else model, "device": config.device, "dtype": config.dtype, "prompt_len": prompt_len,
            "output_len": output_len, "num_requests": counts if len(set(counts)) > 1 else counts[0],
            "num_rounds": num_rounds, "num_prefill": num_prefill, "num_decode": num_decode, "targets": list(targets),
            "pid_namespaces": pid_namespaces,
        }
        vocab = ModelConfig.from_pretrained(model).vocab_size
        with ExitStack() as stack:  # stops the mesh and the local server whatever happens
            apis: dict[str, str] = {}
            local = LocalServer(config, state / "local.log") if "http" in targets else None
            if local is not None:
                stack.callback(local.stop)
            if "mesh" in targets:  # starts while the local server loads its model
                mesh = Mesh(model, num_prefill, num_decode, free_port(), state / "mesh", extra_env=mesh_env,
                            pid_namespaces=pid_namespaces)  # fmt: skip
                stack.callback(mesh.stop)
                mesh.start()
            if local is not None:
                local.wait_ready()
                apis["http"] = local.url
            if "mesh" in targets:
                apis["mesh"] = mesh.api_url
            # detokenize=False as in the workers: text is the HTTP layer's job.
            engine = LLMEngine(config, detokenize=False) if "engine" in targets else None
            print(" ".join(f"{k}={v if v is not None else 'tiny (made)'}" for k, v in run.items() if k != "targets"))
            for t in targets:
                print(f"  {t:<6} {_LEGEND[t]}")
            print("runs, in order (num_requests per target and round):", flush=True)
            levels = asyncio.run(_measure(engine, apis, vocab, runs, prompt_len, output_len))
        # The mesh has stopped: its services flushed their spans.
        level_breakdowns(state / "mesh" / "traces", levels)
    print_headline(levels, num_rounds)
    print_targets(levels, num_rounds)
    print_breakdowns(levels)
    return {"config": {**run, "engine": asdict(config)}, "levels": levels}
