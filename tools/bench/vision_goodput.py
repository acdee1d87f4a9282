"""Issue 29's GPU figure: goodput of a vision-language mesh at fixed latency targets,
E/P/D against aggregated, and the embedding handoff's time, through the mesh over HTTP
as a user gets it (tools/launch/up.py's Mesh, streamed chat completions, every request
carrying --images-per-request distinct images).

The arms, both meshes up at once (on a GPU, on one card: --kv-cache-memory-bytes sizes
each engine's KV pool so they all fit):

- epd: 1 vision + 1 prefill + 1 decode instance. The vision instance encodes a
  request's images and hands their embeddings to prefill (its shared memory on this
  host, else kvcache), prefill computes the prompt and hands the KV to decode.
- aggregated: one decode instance encodes, prefills and decodes every request
  (conditional disaggregation with balancer.local_prefill_max_tokens past any prompt:
  the balancer sends each request whole to decode, which runs the tower on the PNGs
  itself). The mesh still starts one prefill instance, idle: the balancer's /ready
  wants one live (services/balancer/service.py); it holds its weights and KV pool on
  the card but computes nothing (the trace's `prefill.local` says so per request, and
  the report counts the requests prefilled on decode).

At each concurrency level (closed loop) each arm is warmed (tools/bench/rounds.py's
plan: a warm-up run, then one dropped round), then the arms take turns for --rounds
timed rounds, round r starting at arm r mod 2; both arms get the same requests in a
round (distinct images and text per request and round: no cache serves one). Per arm
and round: goodput = requests meeting both --ttft-target-ms and --tpot-target-ms per
second of the round's wall time (and their output tokens/s), TTFT and TPOT p50/p90.
Per round, the ratio epd / aggregated of each; the report gives their median and
spread (min-max). From the meshes' traces (read once they stop), per arm and level
over the timed rounds: the embedding handoff (prefill's `transfer` span of
image_embeddings, shared/stage/images.py: its time, bytes and path), the vision
instance's `encode` span and the balancer's `vision` span (asking the instance to its
reply), and the PNG path's `images` span (the image processor, where prefill or decode
encodes).

    python -m tools.bench.vision_goodput --model models/qwen2.5-vl-3b --device cuda --dtype bfloat16 \\
        --concurrency 1 4 16 --out docs/perf/vision_goodput_h200.txt --json docs/perf/vision_goodput_h200.json
"""

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from shared.runtime.settings import env_name
from tools.bench.mesh_bench import bench_state
from tools.bench.openai_stream import RequestResult, RequestSpec
from tools.bench.raw_file import add_json_flag, run_header, tee_stdout, write_json
from tools.bench.rounds import MIN_TIMED_ROUNDS, Run, plan, spread
from tools.bench.vision_bench import closed_loop, pct, png_data_url
from tools.launch.trace_view import load_spans
from tools.launch.up import Mesh, free_port

ARM, BASELINE = "epd", "aggregated"
FAST_BEATS = {env_name("worker", "heartbeat_interval_s"): "0.2"}
# Past any prompt: the balancer sends every request whole to decode (policies.choose_prefill_site).
EVERY_PROMPT_ON_DECODE = str(1 << 30)
RATIO_METRICS = ("goodput_req_s", "goodput_tok_s", "out_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms")
TRACE_SPANS = ("handoff", "encode", "vision", "images")


@dataclass(frozen=True, slots=True)
class ArmShape:
    num_vision: int
    env: Mapping[str, str] = field(default_factory=dict)


ARMS: Mapping[str, ArmShape] = {
    ARM: ArmShape(num_vision=1),
    BASELINE: ArmShape(num_vision=0, env={env_name("balancer", "local_prefill_max_tokens"): EVERY_PROMPT_ON_DECODE}),
}


# -- the requests --------------------------------------------------------------------------


def test_image(rng: np.random.Generator, px: int) -> str:
    """A distinct px x px picture: a random 8 x 8 grid of colours blown up, with a little
    noise (PNG keeps it small on the wire; its identity is its pixels, so no cache
    serves it twice)."""
    cells = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    scale = -(-px // 8)
    picture = np.kron(cells, np.ones((scale, scale, 1), dtype=np.uint8))[:px, :px]
    noise = rng.integers(0, 8, picture.shape, dtype=np.uint8)
    return png_data_url(picture + noise)


def request_specs(seed: Sequence[int], num: int, images: int, px: int, max_tokens: int) -> list[RequestSpec]:
    """One run's requests (the same for both arms of a round): a unique text first (no
    request shares a prefix block with another), then the images, then a question."""
    rng = np.random.default_rng([*seed, 29])
    specs = []
    for i in range(num):
        text = f"Request {'-'.join(map(str, seed))}-{i}: " + " ".join(str(int(x)) for x in rng.integers(0, 1000, 6))
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        content += [{"type": "image_url", "image_url": {"url": test_image(rng, px)}} for _ in range(images)]
        content.append({"type": "text", "text": "Compare the pictures."})
        specs.append(RequestSpec(messages=[{"role": "user", "content": content}], max_tokens=max_tokens,  # type: ignore[list-item]
                                 extra_body={"temperature": 0, "ignore_eos": True}))  # fmt: skip
    return specs


# -- one run's figures -------------------------------------------------------------------


def summarize(results: Sequence[RequestResult], wall_s: float, ttft_target_ms: float,
              tpot_target_ms: float) -> dict[str, Any]:  # fmt: skip
    """One arm's run: goodput (the requests that met both targets, per second of the run)
    and its latencies. A one-token answer has no TPOT: it meets that target."""
    ok = [r for r in results if r.success]
    errors = [r.error for r in results if not r.success]
    row: dict[str, Any] = {"ok": len(ok), "failed": len(errors), "errors": errors[:3], "wall_s": wall_s}
    if not ok:
        return row
    ttft = [r.ttft_s * 1000 for r in ok]
    tpot = [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]
    good = [r for r in ok if r.ttft_s * 1000 <= ttft_target_ms
            and (r.tpot_s is None or r.tpot_s * 1000 <= tpot_target_ms)]  # fmt: skip
    row.update(
        req_s=len(ok) / wall_s,
        out_tok_s=sum(r.num_output_tokens for r in ok) / wall_s,
        goodput_req_s=len(good) / wall_s,
        goodput_tok_s=sum(r.num_output_tokens for r in good) / wall_s,
        good=len(good),
        ttft_p50_ms=statistics.median(ttft),
        ttft_p90_ms=pct(ttft, 90),
        tpot_p50_ms=statistics.median(tpot) if tpot else float("nan"),
        tpot_p90_ms=pct(tpot, 90) if tpot else float("nan"),
        prompt_tokens_p50=statistics.median(r.num_prompt_tokens for r in ok),
    )
    return row


def ratios(rounds: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """epd / aggregated per round for each metric, then their median and min-max. A round
    where the aggregated arm's figure is 0 (no request met the targets) gives no ratio:
    `rounds_with_ratio` counts those that did."""
    out: dict[str, dict[str, Any]] = {}
    for metric in RATIO_METRICS:
        per_round = [r[ARM][metric] / r[BASELINE][metric] for r in rounds
                     if metric in r[ARM] and metric in r[BASELINE] and r[BASELINE][metric] > 0]  # fmt: skip
        out[metric] = {"rounds_with_ratio": len(per_round), **(spread(per_round) if per_round else {})}
    return out


# -- the traces ------------------------------------------------------------------------------


def _ms(span: Mapping[str, Any]) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e6


def trace_figures(spans: Sequence[Mapping[str, Any]], windows: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The image spans of the requests whose root span started inside one of windows
    (unix ns): per request, the embedding handoff (prefill's transfer span of
    image_embeddings), the vision instance's encode span, the balancer's vision span,
    and the image processor's images span (where prefill or decode encodes the PNGs);
    how many requests decode prefilled itself."""
    by_trace: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    times: dict[str, list[float]] = {name: [] for name in TRACE_SPANS}
    handoff_bytes: list[int] = []
    paths: Counter[str] = Counter()
    requests = local = 0
    for trace in by_trace.values():
        root = next((s for s in trace if s["parent_id"] is None and "request.id" in s["attributes"]), None)
        if root is None or not any(a <= root["start_ns"] <= b for a, b in windows):
            continue
        requests += 1
        named: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for s in trace:
            named[s["name"]].append(s)
        local += any(s["attributes"].get("prefill.local") for s in named["decode"])
        prefill_ids = {s["span_id"] for s in named["prefill"]}
        for s in named["transfer"]:
            a = s["attributes"]
            if s["parent_id"] in prefill_ids and a.get("transfer.what") == "image_embeddings":
                times["handoff"].append(_ms(s))
                paths[f"{a.get('transfer.path', '?')}:{a.get('transfer.outcome', '?')}"] += 1
                if "transfer.bytes" in a:
                    handoff_bytes.append(int(a["transfer.bytes"]))
        times["encode"] += [_ms(s) for s in named["encode"]]
        times["vision"] += [_ms(s) for s in named["vision"] if s["attributes"].get("vision.site") == "vision"]
        times["images"] += [_ms(s) for s in named["images"]]
    out: dict[str, Any] = {"requests": requests, "prefilled_on_decode": local, "handoff_paths": dict(paths)}
    for name, values in times.items():
        out[f"{name}_n"] = len(values)
        if values:
            out[f"{name}_ms_p50"], out[f"{name}_ms_p90"] = statistics.median(values), pct(values, 90)
    if handoff_bytes:
        out["handoff_mb_p50"] = statistics.median(handoff_bytes) / 1e6
        if out.get("handoff_ms_p50"):
            out["handoff_gb_s_p50"] = statistics.median(b / (t * 1e6) for b, t in zip(handoff_bytes, times["handoff"]) if t > 0)
    return out


# -- the run ---------------------------------------------------------------------------------


async def measure(meshes: Mapping[str, Mapping[str, Any]], runs: Sequence[Run],
                  args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[tuple[int, str], list[tuple[int, int]]]]:  # fmt: skip
    """Every run of the plan, in order: the levels' figures and, per (level, arm), the
    timed runs' windows (unix ns) for the traces."""
    clients = {n: httpx.AsyncClient(base_url=m["url"], timeout=httpx.Timeout(600.0, connect=10.0))
               for n, m in meshes.items()}  # fmt: skip
    levels: list[dict[str, Any]] = []
    windows: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    try:
        models = {n: (await c.get("/models")).raise_for_status().json()["data"][0]["id"] for n, c in clients.items()}
        specs_of: dict[tuple[int, int], list[RequestSpec]] = {}
        for run in runs:
            if run.level == len(levels):
                levels.append({"concurrency": run.concurrency, "rounds": defaultdict(dict), "dropped": defaultdict(dict)})
            key = (run.level, run.seed[1])
            if key not in specs_of:  # built before the clock starts: the same for both arms
                specs_of = {key: request_specs(run.seed, run.num_requests, args.images_per_request, args.image_px,
                                               args.max_tokens)}  # fmt: skip
            start_ns, start = time.time_ns(), time.perf_counter()
            results = await closed_loop(clients[run.target], models[run.target], specs_of[key], run.concurrency)
            wall, end_ns = time.perf_counter() - start, time.time_ns()
            row = summarize(results, wall, args.ttft_target_ms, args.tpot_target_ms)
            label = "warm-up" if run.round is None else f"round {run.round}" + ("" if run.timed else " (dropped)")
            print(f"  conc {run.concurrency:>3} {label:18s} {run.target:10s} {fmt(row)}", flush=True)
            if run.timed:
                assert run.round is not None
                levels[-1]["rounds"][run.round][run.target] = row
                windows[(run.level, run.target)].append((start_ns, end_ns))
            elif run.round is not None:
                levels[-1]["dropped"][run.round][run.target] = row
    finally:
        for c in clients.values():
            await c.aclose()
    for level in levels:
        level["rounds"] = [level["rounds"][r] for r in sorted(level["rounds"])]
        level["dropped"] = [level["dropped"][r] for r in sorted(level["dropped"])]
        level["arms"] = {arm: {m: spread([r[arm][m] for r in level["rounds"] if m in r[arm]])
                               for m in (*RATIO_METRICS, "tpot_p90_ms", "req_s") if all(m in r[arm] for r in level["rounds"])}
                         for arm in ARMS}  # fmt: skip
        level["ratio"] = ratios(level["rounds"])
    return levels, windows


def fmt(row: Mapping[str, Any]) -> str:
    if not row.get("ok"):
        return f"FAILED {row.get('errors')}"
    text = (f"goodput {row['goodput_req_s']:6.2f} req/s {row['goodput_tok_s']:7.1f} tok/s ({row['good']}/{row['ok']} "
            f"met)  ttft p50 {row['ttft_p50_ms']:7.1f} p90 {row['ttft_p90_ms']:7.1f} ms  tpot p50 "
            f"{row['tpot_p50_ms']:6.1f} p90 {row['tpot_p90_ms']:6.1f} ms")  # fmt: skip
    return text + (f"  ({row['failed']} failed: {row['errors'][:1]})" if row.get("failed") else "")


def _s(f: Mapping[str, float] | None, digits: int = 1) -> str:
    if not f or "median" not in f:
        return "n/a"
    return f"{f['median']:.{digits}f} [{f['min']:.{digits}f}-{f['max']:.{digits}f}]"


def report(levels: Sequence[Mapping[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{ARM} against {BASELINE}: median [min-max] of {args.rounds} timed rounds; targets TTFT <= "
          f"{args.ttft_target_ms:g} ms, TPOT <= {args.tpot_target_ms:g} ms; ratio per round, {ARM} / {BASELINE}")
    for level in levels:
        print(f"\nconcurrency {level['concurrency']}")
        for metric in RATIO_METRICS:
            digits = 2 if metric.endswith("req_s") else 1
            arms = "   ".join(f"{arm} {_s(level['arms'][arm].get(metric), digits):>24}" for arm in ARMS)
            r = level["ratio"][metric]
            ratio = _s(r, 3) + (f" ({r['rounds_with_ratio']} of {args.rounds} rounds)"
                                if r["rounds_with_ratio"] < args.rounds else "")  # fmt: skip
            print(f"  {metric:14s} {arms}   ratio {ratio}")
        for arm in ARMS:
            t = level.get("traces", {}).get(arm)
            if not t:
                continue
            parts = [f"{t['requests']} requests", f"{t['prefilled_on_decode']} prefilled on decode"]
            for name in TRACE_SPANS:
                if t.get(f"{name}_n"):
                    parts.append(f"{name} {t[name + '_ms_p50']:.1f}/{t[name + '_ms_p90']:.1f} ms (n {t[name + '_n']})")
            if "handoff_mb_p50" in t:
                parts.append(f"handoff {t['handoff_mb_p50']:.3f} MB, {t.get('handoff_gb_s_p50', float('nan')):.3f} GB/s")
            if t["handoff_paths"]:
                parts.append(f"paths {t['handoff_paths']}")
            print(f"  traces {arm:10s} (p50/p90): " + "; ".join(parts))


def mesh_env(args: argparse.Namespace) -> dict[str, str]:
    """The engines' settings every arm's processes get (the rest: this environment's)."""
    engine = {"device": args.device, "dtype": args.dtype, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
              "max_model_len": args.max_model_len}  # fmt: skip
    env = {env_name("engine", k): str(v) for k, v in engine.items() if v is not None}
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    return {**FAST_BEATS, **env}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.vision_goodput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", help="a Qwen2.5-VL folder (make-model --preset qwen2.5-vl-3b); default: a seeded "
                   "tiny-vl made here")
    p.add_argument("--device", default=None, help="the engines' device (default: the settings')")
    p.add_argument("--dtype", default=None, help="the engines' dtype (default: the settings')")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="each engine's KV pool (every engine of both meshes shares the card)")
    p.add_argument("--max-model-len", type=int, default=None, help="the engines' longest request (default: the model's)")
    p.add_argument("--images-per-request", type=int, default=4)
    p.add_argument("--image-px", type=int, default=448, help="side of the square test images, pixels")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="closed-loop levels")
    p.add_argument("--num-requests", type=int, nargs="+", default=None,
                   help="requests per arm and round, one per level (default: 4 x the level, at least 8)")
    p.add_argument("--rounds", type=int, default=3, help=f"timed rounds per level (at least {MIN_TIMED_ROUNDS})")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--ttft-target-ms", type=float, default=2000.0)
    p.add_argument("--tpot-target-ms", type=float, default=50.0)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every process of both meshes (repeat), e.g. INFERMESH_VISION__SHARE_BYTES=...")
    p.add_argument("--device-note", default="", help="printed first: what the header's device cannot say (loaded, ...)")
    p.add_argument("--state-dir", default=None, help="keep the meshes' logs and traces here")
    p.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    add_json_flag(p)
    args = p.parse_args(argv)
    num_requests = args.num_requests or [max(8, 4 * c) for c in args.concurrency]
    if len(num_requests) != len(args.concurrency):
        p.error("--num-requests: one per --concurrency level")
    if args.rounds < MIN_TIMED_ROUNDS:
        p.error(f"--rounds: at least {MIN_TIMED_ROUNDS} timed rounds (a median and a spread)")
    if min(args.images_per_request, args.image_px, args.max_tokens, *args.concurrency, *num_requests) < 1:
        p.error("every count and size must be at least 1")
    if any("=" not in item for item in args.env):
        p.error("--env takes KEY=VALUE")
    runs = plan(list(ARMS), args.concurrency, num_requests, args.rounds)
    header = run_header()
    out: dict[str, Any] = {}
    with tee_stdout(args.out, header), bench_state(args.state_dir, "infermesh-vision-goodput-", "the meshes' logs") as state:
        if args.device_note:
            print(f"# device: {args.device_note}")
        model = args.model
        if model is None:
            from tools.make_model import make_model

            make_model(state / "tiny-vl", arch="qwen2_5_vl", preset="tiny-vl", seed=3)
            model = str(state / "tiny-vl")
        env = mesh_env(args)
        print(f"# model {model if args.model else 'tiny-vl (made)'}; {args.images_per_request} images of "
              f"{args.image_px} px per request, max_tokens {args.max_tokens}; levels {args.concurrency}, requests "
              f"{num_requests}; both meshes up at once; engine settings {env}")
        print(f"# {ARM}: 1 vision + 1 prefill + 1 decode; {BASELINE}: the decode instance encodes, prefills and "
              "decodes every request (local_prefill_max_tokens past any prompt), beside an idle prefill instance "
              "the balancer's /ready wants")
        out["load_average_before"] = os.getloadavg()
        print(f"# load average before: {out['load_average_before']}; {os.cpu_count()} cores", flush=True)
        meshes: dict[str, Mesh] = {}
        try:
            for name, shape in ARMS.items():
                print(f"starting {name} ({shape.num_vision} vision)", flush=True)
                meshes[name] = Mesh(model, num_prefill=1, num_decode=1, num_vision=shape.num_vision, port=free_port(),
                                    state_dir=state / name, extra_env={**env, **shape.env})  # fmt: skip
                meshes[name].start(timeout_s=600)
            levels, windows = asyncio.run(measure({n: {"url": m.api_url} for n, m in meshes.items()}, runs, args))
        finally:
            for mesh in meshes.values():
                mesh.stop()  # its processes flush their spans as they stop
        for name, mesh in meshes.items():
            spans = load_spans(mesh.trace_dir)
            for i, level in enumerate(levels):
                level.setdefault("traces", {})[name] = trace_figures(spans, windows[(i, name)])
        report(levels, args)
        out["levels"] = levels
        out["load_average_after"] = os.getloadavg()
        print(f"\n# load average after: {out['load_average_after']}", flush=True)
        out["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "out")}
        out["engine_env"] = env
    if args.json:
        write_json(args.json, out, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
