"""The vision stage's CPU figures (issue 29), each side by side in one run, through the
mesh over HTTP as a user gets it (tools/launch/up.py's Mesh, a seeded tiny-vl
Qwen2.5-VL, streamed chat completions):

- cache: a repeated-image workload (a pool of images, each request one of them, its
  text unique so the prefix cache never serves it) on E/P/D with the vision embedding
  cache (the default) against the same mesh with vision.reuse_embeddings off (every
  image encoded again): TTFT p50/p90.
- epd: a mixed load (half the requests text only, half with a distinct image) on E/P/D
  (1 vision + 1 prefill + 1 decode) against E/PD (1 prefill + 1 decode, prefill
  encodes): TTFT p50/p90, end-to-end p50.

Every arm is a mesh of its own, all started before the first request. Each arm is warmed
(one round, dropped), then the arms take turns for --rounds timed rounds, round r starting
at arm r mod 2 (tools/bench/rounds.py's rotation); each round sends both arms the same
requests (closed loop, --concurrency). A ratio is taken per round between the two arms
that ran side by side; the report gives its median and spread (min-max). The load
average is printed before and after: the machine is shared.

    python -m tools.bench.vision_bench --json docs/perf/vision_cpu.json --log docs/perf/vision_cpu.log
"""

import argparse
import asyncio
import base64
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tools.bench.openai_stream import RequestResult, RequestSpec, send
from tools.bench.raw_file import run_header, tee_stdout, write_json
from tools.bench.rounds import rotation
from tools.launch.up import Mesh, free_port

FAST_BEATS = {"INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}
ARMS = {
    # figure: (arm, baseline) and how each mesh runs
    "cache": {"cache": {"num_vision": 1, "extra_env": {}},
              "no_cache": {"num_vision": 1, "extra_env": {"INFERMESH_VISION__REUSE_EMBEDDINGS": "false"}}},
    "epd": {"epd": {"num_vision": 1, "extra_env": {}},
            "e_pd": {"num_vision": 0, "extra_env": {}}},
}


def png_data_url(pixels: np.ndarray) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def random_image(rng: np.random.Generator, size: int) -> str:
    return png_data_url(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def chat_spec(text: str, image: str | None, max_tokens: int) -> RequestSpec:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image}})
        content.append({"type": "text", "text": "What is in the picture?"})
    return RequestSpec(messages=[{"role": "user", "content": content}], max_tokens=max_tokens,  # type: ignore[list-item]
                       extra_body={"temperature": 0, "ignore_eos": True})


def workload(figure: str, round_seed: int, num: int, pool: Sequence[str], size: int, max_tokens: int) -> list[RequestSpec]:
    """The requests of one round (the same for both arms of that round)."""
    rng = np.random.default_rng(round_seed)
    specs = []
    for i in range(num):
        # A unique text first: no request shares a prefix block with another.
        text = f"Request {round_seed}-{i}: " + " ".join(str(int(x)) for x in rng.integers(0, 1000, 6))
        if figure == "cache":
            specs.append(chat_spec(text, pool[int(rng.integers(len(pool)))], max_tokens))
        else:  # mixed: every other request carries a distinct image
            specs.append(chat_spec(text, random_image(rng, size) if i % 2 else None, max_tokens))
    return specs


async def closed_loop(client: httpx.AsyncClient, model: str, specs: list[RequestSpec],
                      concurrency: int) -> list[RequestResult]:  # fmt: skip
    queue = list(enumerate(specs))
    results: list[RequestResult | None] = [None] * len(specs)
    start = time.perf_counter()

    async def worker() -> None:
        while queue:
            i, spec = queue.pop(0)
            results[i] = await send(client, model, spec, start)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    errors = [r.error for r in results if not r.success]
    if not ok:
        return {"ok": 0, "errors": errors[:3]}
    ttft = [r.ttft_s * 1000 for r in ok]
    e2e = [r.e2e_s * 1000 for r in ok]
    return {"ok": len(ok), "failed": len(errors), "ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": pct(ttft, 90), "e2e_p50_ms": statistics.median(e2e), "errors": errors[:3]}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def start_mesh(model: str, state: Path, name: str, num_vision: int, extra_env: dict[str, str]) -> Mesh:
    mesh = Mesh(model, num_prefill=1, num_decode=1, num_vision=num_vision, port=free_port(),
                state_dir=state / name, extra_env={**FAST_BEATS, **extra_env})  # fmt: skip
    mesh.start(timeout_s=300)
    return mesh


async def run_figure(figure: str, meshes: dict[str, Mesh], args: argparse.Namespace) -> dict[str, Any]:
    arm, base = list(ARMS[figure])
    pool_rng = np.random.default_rng(7)
    pool = [random_image(pool_rng, args.image_size) for _ in range(args.pool)]
    clients = {n: httpx.AsyncClient(base_url=m.api_url, timeout=httpx.Timeout(300.0, connect=10.0))
               for n, m in meshes.items()}  # fmt: skip
    try:
        models = {n: (await c.get("/models")).raise_for_status().json()["data"][0]["id"] for n, c in clients.items()}
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(-1, args.rounds):  # -1: the warm-up, dropped
            specs = workload(figure, 1000 * (r + 2) + (0 if figure == "cache" else 500), args.requests, pool,
                             args.image_size, args.max_tokens)
            row: dict[str, dict[str, Any]] = {}
            for name in rotation([arm, base], max(r, 0)):
                results = await closed_loop(clients[name], models[name], specs, args.concurrency)
                row[name] = summarize(results)
                print(f"  {figure} round {'warm-up' if r < 0 else r}: {name:9s} {fmt(row[name])}", flush=True)
            if r >= 0:
                rounds.append(row)
    finally:
        for c in clients.values():
            await c.aclose()
    figures: dict[str, Any] = {"arm": arm, "baseline": base, "rounds": rounds}
    for metric in ("ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms"):
        pairs = [(row[arm][metric], row[base][metric]) for row in rounds if metric in row[arm] and metric in row[base]]
        if pairs:
            figures[metric] = {arm: spread([a for a, _ in pairs]), base: spread([b for _, b in pairs]),
                               "ratio": spread([a / b for a, b in pairs])}
    return figures


def fmt(row: dict[str, Any]) -> str:
    if not row.get("ok"):
        return f"FAILED {row.get('errors')}"
    text = f"ttft p50 {row['ttft_p50_ms']:7.1f} ms  p90 {row['ttft_p90_ms']:7.1f} ms  e2e p50 {row['e2e_p50_ms']:7.1f} ms"
    return text + (f"  ({row['failed']} failed: {row['errors'][:1]})" if row.get("failed") else "")


def report(figure: str, figures: dict[str, Any]) -> None:
    arm, base = figures["arm"], figures["baseline"]
    print(f"\n{figure}: {arm} against {base} (median of {len(figures['rounds'])} rounds, [min-max]; "
          "ratio per round, arm / baseline)")
    for metric in ("ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms"):
        f = figures.get(metric)
        if f is None:
            continue
        a, b, ratio = f[arm], f[base], f["ratio"]
        print(f"  {metric:12s} {arm} {a['median']:7.1f} [{a['min']:.1f}-{a['max']:.1f}]   {base} {b['median']:7.1f} "
              f"[{b['min']:.1f}-{b['max']:.1f}]   ratio {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.vision_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", default="cache,epd", help="cache, epd or both")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per figure (after a dropped warm-up)")
    parser.add_argument("--requests", type=int, default=12, help="requests per arm and round")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224, help="side of the square test images, pixels")
    parser.add_argument("--pool", type=int, default=4, help="distinct images of the repeated-image workload")
    parser.add_argument("--model", help="a vision-language model folder; default: a seeded tiny-vl made here")
    parser.add_argument("--json", help="raw file of the figures (docs/perf/...)")
    parser.add_argument("--log", help="raw file of what is printed")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3 timed rounds")
    figures_wanted = [f for f in args.figures.split(",") if f]
    header = run_header()  # the command as typed (sys.orig_argv)
    out: dict[str, Any] = {}
    with tee_stdout(args.log, header), tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        state = Path(tmp)
        model = args.model
        if model is None:
            from tools.make_model import make_model

            make_model(state / "tiny-vl", arch="qwen2_5_vl", preset="tiny-vl", seed=3)
            model = str(state / "tiny-vl")
        out["load_average_before"] = os.getloadavg()
        print(f"load average before: {out['load_average_before']}; {os.cpu_count()} cores", flush=True)
        for figure in figures_wanted:
            meshes: dict[str, Mesh] = {}
            try:
                for name, options in ARMS[figure].items():
                    print(f"starting {name} ({options})", flush=True)
                    meshes[name] = start_mesh(model, state / figure, name, **options)
                out[figure] = asyncio.run(run_figure(figure, meshes, args))
            finally:
                for mesh in meshes.values():
                    mesh.stop()
            report(figure, out[figure])
        out["load_average_after"] = os.getloadavg()
        print(f"\nload average after: {out['load_average_after']}", flush=True)
        out["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "log")}
    if args.json:
        write_json(args.json, out, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
