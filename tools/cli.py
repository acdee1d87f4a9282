"""The `infermesh` command. Each subcommand parses its flags here and hands
over to the module that does the work."""

import argparse
import dataclasses
import json
import sys
import types
import typing
from typing import Any

from shared.engine.config import (
    DTYPES, KERNEL_CHOICES, QUANTIZED_WEIGHTS_CHOICES, SPEC_SCHEDULE_CHOICES, SPECULATIVE_CHOICES, SWA_REPLAY_CHOICES,
    EngineConfig,
)  # fmt: skip
from shared.engine.sampling_params import SamplingParams
from shared.model.models import ARCHITECTURE_OF_MODEL_TYPE
from shared.runtime.settings import field_docs
from tools.bench.catalog import BENCHES, PLOT_COMMAND, Bench, find
from tools.bench.raw_file import add_json_flag

# Engine knobs whose flag would collide with a subcommand's own (generate's --seed is the sampling seed).
_ENGINE_FLAG_NAMES = {"seed": "--engine-seed"}
_ENGINE_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "kernels": KERNEL_CHOICES,
    "quantized_weights": QUANTIZED_WEIGHTS_CHOICES,
    "speculative": SPECULATIVE_CHOICES,
    "spec_schedule": SPEC_SCHEDULE_CHOICES,
    "swa_replay": SWA_REPLAY_CHOICES,
}


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field but model (--block-size for block_size),
    its help the field's docstring. Every flag defaults to None: a flag not given
    leaves the knob to EngineConfig (or, for bench-mesh, to the environment), so
    each knob keeps one default, declared in EngineConfig."""
    group = p.add_argument_group("engine", "the engine's configuration (EngineConfig; `infermesh config` lists it)")
    docs = field_docs(EngineConfig)
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None: the flag takes an X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = _ENGINE_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        text = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction, help=text)
        else:
            group.add_argument(flag, dest=f"engine_{f.name}", type=kind, choices=_ENGINE_CHOICES.get(f.name),
                               metavar=None if f.name in _ENGINE_CHOICES else f.name.upper(), help=text)


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine knobs given on the command line, by field name."""
    given = {f.name: getattr(args, f"engine_{f.name}", None) for f in dataclasses.fields(EngineConfig)}
    return {name: value for name, value in given.items() if value is not None}


def _cmd_make_model(args: argparse.Namespace) -> int:
    import torch

    from tools.make_model import make_model

    num_params = make_model(
        args.path, arch=args.arch, seed=args.seed, preset=args.preset, sliding_window=args.sliding_window,
        dtype=getattr(torch, args.dtype), device=args.device,
    )  # fmt: skip
    print(
        f"wrote a seeded {args.arch} checkpoint to {args.path}: preset {args.preset}, "
        f"{num_params:,} params, {args.dtype}, drawn on {args.device}",
        file=sys.stderr,
    )
    return 0


def _parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids takes integers separated by spaces or commas, got {text!r}")


def _cmd_generate(args: argparse.Namespace) -> int:
    from shared.engine.llm import LLM

    if not args.prompt and not args.prompt_ids:
        raise SystemExit("give at least one --prompt or --prompt-ids")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop or [],
    )
    llm = LLM(EngineConfig(model=args.model, **engine_flags(args)), load_progress=True)
    prompts: list[str | list[int]] = []
    for text in args.prompt or []:
        if args.chat:
            prompts.append(llm.recipe.encode_chat([{"role": "user", "content": text}]))
        else:
            prompts.append(text)
    prompts += [_parse_prompt_ids(t) for t in args.prompt_ids or []]
    outputs = llm.generate(prompts, params)
    for out in outputs:
        if args.json:
            record = {
                "text": out.text,
                "token_ids": out.token_ids,
                "prompt_token_ids": out.prompt_token_ids,
                "finish_reason": out.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(out.text)
            print(f"--- ({len(out.token_ids)} tokens, finish_reason={out.finish_reason})")
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from tools.bench.engine_bench import run_engine_bench
    from tools.bench.raw_file import write_rows

    rows = run_engine_bench(
        model=args.model,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        engine_flags=engine_flags(args),
        compare_transformers=not args.no_transformers,
    )
    write_rows(args.json, rows, prompt_len=args.prompt_len, output_len=args.output_len)
    return 0


def _cmd_bench_mesh(args: argparse.Namespace) -> int:
    from tools.bench.mesh_bench import run_mesh_bench

    run_mesh_bench(
        model=args.model,
        concurrency=args.concurrency,
        num_requests=args.num_requests[0] if len(args.num_requests) == 1 else args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        num_rounds=args.rounds,
        num_prefill=args.prefill,
        num_decode=args.decode,
        targets=tuple(args.targets),
        engine_flags=engine_flags(args),
        state_dir=args.state_dir,
        json_path=args.json,
        pid_namespaces=args.pid_namespaces,
        log_path=args.log,
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import os

    from tools.bench.serve_bench import LoadLevel, Slo, run_bench
    from tools.bench.workloads import WorkloadConfig

    if (args.concurrency is None) == (args.request_rate is None):
        raise ValueError("give --concurrency (closed loop) or --request-rate (open loop), one of them")
    if args.concurrency is not None:
        levels = [LoadLevel(concurrency=c) for c in args.concurrency]
    else:
        levels = [LoadLevel(request_rate=r, max_concurrency=args.max_concurrency, burstiness=args.burstiness)
                  for r in args.request_rate]
    extra: dict[str, Any] = {"temperature": args.temperature}
    if not args.no_ignore_eos:
        extra["ignore_eos"] = True
    workload = WorkloadConfig(
        name=args.workload, input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, turns=args.turns,
        prompt_format="text" if args.workload == "multi-turn" else args.prompt_format, extra_body=extra,
    )  # fmt: skip
    report = run_bench(
        args.base_url, levels, workload, num_prompts=args.num_prompts, model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), percentiles=args.percentiles,
        slo=Slo.parse(args.goodput or []), seed=args.seed, num_warmup=args.warmup, out_dir=args.out,
    )  # fmt: skip
    failed = sum(level["figures"]["failed"] for level in report["levels"])
    return 1 if failed else 0


def _request_rate(text: str) -> float:
    """--request-rate's values: requests per second, or inf (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rate is requests per second or 'inf', not {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be positive, not {text}")
    return rate


def _cmd_bench_gpu(args: argparse.Namespace) -> int:
    from tools.bench.gpu_bench import run_gpu_bench

    if args.profile:
        from tools.bench.gpu_profile import run_profile

        run_profile(args.out)
        return 0
    if args.overlap_only:
        from tools.bench.gpu_bench import run_overlap_bench

        run_overlap_bench(args.out)
        return 0
    from tools.bench.gpu_bench import DEFAULT_ROWS, parse_rows

    run_gpu_bench(args.out, hf_rows=not args.no_transformers, spec=parse_rows(args.rows) if args.rows else DEFAULT_ROWS)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tools.launch.up import up

    if args.model is None:
        args.model = "models/default"
        if not (Path(args.model) / "config.json").exists():
            from tools.make_model import make_model

            print(f"making the default model in {args.model}", file=sys.stderr)
            make_model(args.model)
    return up(args.model, args.prefill, args.decode, args.port, args.state_dir, args.demo,
              args.tensor_parallel_size, args.enable_expert_parallel, args.enable_eplb, args.eplb_config,
              num_vision=args.vision, data_parallel_size=args.data_parallel_size,
              planner_profile=args.planner, served_model_names=args.served_model_name)  # fmt: skip


def _cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tools.planner.sweep import SweepConfig, run_sweep

    config = SweepConfig(
        url=args.url, out=Path(args.out), metrics_urls=tuple(args.metrics_url or ()), budget_s=args.budget_s,
        prefill_lengths=tuple(args.prefill_lengths), prefill_concurrency=tuple(args.prefill_concurrency),
        decode_batches=tuple(args.decode_batches), decode_contexts=tuple(args.decode_contexts),
        decode_max_tokens=args.decode_max_tokens, vision_concurrency=tuple(args.vision_concurrency),
        vision_image_px=tuple(args.vision_image_px), kvcache_lengths=tuple(args.kvcache_lengths),
        rounds=args.rounds, holdout=args.holdout,
        raw=Path(args.raw) if args.raw else None, plot=not args.no_plot, model_dir=args.model_dir,
        device=args.device, api_key=args.api_key, seed=args.seed, note=args.note,
    )  # fmt: skip
    run_sweep(config)
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from tools.launch.trace_view import load_spans, pick_trace, render_waterfall
    from shared.runtime.settings import load_settings

    trace_dir = args.trace_dir or load_settings().telemetry.trace_dir
    try:
        spans = pick_trace(load_spans(trace_dir), args.which)
    except LookupError as exc:
        print(f"infermesh: {exc} (in {trace_dir})", file=sys.stderr)
        return 1
    print(render_waterfall(spans))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from shared.runtime.settings import describe, load_settings

    print(describe(load_settings()))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.planner.helm_values import helm_values, options_for
    from services.planner.plan import InfeasibleTarget, Lengths, Targets, Workload, plan
    from services.planner.plan_text import describe
    from services.planner.profile import Profile

    profile = Profile.load(args.profile)
    workload = Workload(args.rps, Lengths(args.isl, args.isl_p90), Lengths(args.osl, args.osl_p90), args.prefix_hit,
                        args.images_per_request, args.image_px)
    targets = Targets(args.ttft_ms, args.itl_ms, args.percentile)
    try:
        planned = plan(profile, workload, targets, args.gpu_hour_usd)
    except InfeasibleTarget as exc:
        print(f"infermesh plan: infeasible: {exc}", file=sys.stderr)
        return 3
    print(describe(planned, targets, args.gpu_hour_usd))
    if args.values_out:
        header = f"infermesh plan for {profile.model} on {profile.device}, profile {args.profile}"
        Path(args.values_out).write_text(helm_values(planned, options_for(profile.devices_per_instance, profile.device),
                                                     header))
        print(f"wrote {args.values_out}")
    return 0


def _cmd_catalogued(bench: Bench, argv: list[str]) -> int:
    """Hands argv to the bench module's own main: its flags and --help stay the module's."""
    import importlib

    module = importlib.import_module(f"tools.bench.{bench.module}")
    return int(module.main(argv) or 0)


def _catalogued(command: str) -> Bench:
    bench = find(command)
    assert bench is not None, f"{command} is not in tools/bench/catalog.py"
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infermesh", description=__doc__,
        epilog="Each bench-* command is one benchmark (tools/bench/catalog.py lists them; docs/benchmarks.md says "
        "what each writes); `infermesh bench-<kind> --help` gives its flags.",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-model", help="write a small seeded checkpoint in the HF format")
    p.add_argument("path")
    p.add_argument("--arch", default="llama", choices=list(ARCHITECTURE_OF_MODEL_TYPE))  # the model registry's
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny")
    p.add_argument(
        "--sliding-window", type=int, default=None, metavar="W",
        help="qwen2/qwen3: every other layer sliding with window W; mistral: every layer",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype (drawn in float32, cast per tensor)")  # fmt: skip
    p.add_argument("--device", default="cpu",
                   help="where the weights are drawn, e.g. cuda: much faster for large presets, "
                        "but not the bytes a cpu draw gives")  # fmt: skip
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("generate", help="offline generation")
    p.add_argument("--model", required=True, help="folder of a Hugging Face format checkpoint")
    p.add_argument("--prompt", action="append", help="a prompt (repeat to batch several)")
    p.add_argument("--prompt-ids", action="append", help="a prompt as token ids, e.g. '1 2 3'")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    _add_engine_flags(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("bench-engine", help=_catalogued("bench-engine").help)
    p.add_argument("--model", default=None, help="checkpoint folder (default: make the tiny model)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    add_json_flag(p)
    _add_engine_flags(p)
    p.set_defaults(func=_cmd_bench_engine)

    p = sub.add_parser(
        "bench-mesh", help=_catalogued("bench-mesh").help,
        description="Engine knobs come from the settings (INFERMESH_CONFIG, INFERMESH_ENGINE__*), as the mesh's "
        "services read them, with the flags given here over them, for every target alike.",
    )
    p.add_argument("--model", default=None, help="checkpoint folder (default: make the tiny model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="clients in the closed loop, per level")
    p.add_argument("--num-requests", type=int, nargs="+", default=[16],
                   help="requests per target and round: one count for every level, or one per level")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds per level (at least 3), after a warm-up and one dropped round; the targets "
                   "take turns, round r starting at target r mod n")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefill", type=int, default=1, help="prefill instances of the mesh")
    p.add_argument("--decode", type=int, default=1, help="decode instances of the mesh")
    p.add_argument(
        "--targets", nargs="+", default=["engine", "http", "mesh"], choices=["engine", "http", "mesh"],
        help="engine: in this process; http: OpenAI API over one in-process engine; mesh: the whole mesh",
    )
    p.add_argument("--state-dir", default=None, help="keep logs here (default: a temp dir, removed after a clean run)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON (a raw file: "
                   "tools/bench/raw_file.py's header first)")
    p.add_argument("--log", default=None, metavar="PATH", help="also write what is printed here, under the header")
    p.add_argument("--pid-namespaces", action="store_true",
                   help="the mesh's kvcache, prefill and decode each in a PID namespace of its own, as in "
                        "containers: KV moves through NIXL")
    _add_engine_flags(p)
    p.set_defaults(func=_cmd_bench_mesh)

    p = sub.add_parser(
        "bench", help=_catalogued("bench").help,
        description="Closed-loop concurrency or open-loop request rate against --base-url (ours or anyone's), "
        "one level after another; per level: completed/failed, req/s, goodput, output and total tok/s, peak "
        "concurrency, mean/median/percentiles of TTFT, TPOT, ITL and E2EL. With --out: bench.json and PNG plots. "
        "Exits 1 when a request failed.",
    )
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", default=None, help="model name to ask for (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", help="closed loop: clients per level")
    load.add_argument("--request-rate", nargs="+", type=_request_rate,
                      help="open loop: arrivals per second per level ('inf': all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="open loop: gamma shape of the arrival gaps (1: Poisson; below 1: burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop: at most this many in flight")
    p.add_argument("--workload", default="random", choices=["random", "shared-prefix", "multi-turn"])
    p.add_argument("--num-prompts", type=int, default=64, help="requests (multi-turn: conversations) per level")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (multi-turn: words per user message)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: how many distinct prefixes")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: user turns per conversation")
    p.add_argument("--prompt-format", default="ids", choices=["ids", "text"],
                   help="ids: token-id prompts (exact lengths); text: words, for servers that take only text")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (a vLLM extension)")
    p.add_argument("--percentiles", type=float, nargs="+", default=[50, 90, 99])
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--warmup", type=int, default=1, help="requests sent first and left out of the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="DIR", help="write bench.json, latency_cdf.png, throughput_vs_load.png")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("bench-gpu", help=_catalogued("bench-gpu").help)
    p.add_argument("--out", default="docs/perf", help="folder for gpu_bench.json and gpu_bench.md")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers rows")
    p.add_argument("--overlap-only", action="store_true", help="only the engine's idle gap, step by step vs overlapped")
    p.add_argument("--rows", default=None, metavar="SPEC",
                   help="only these rows, e.g. decode:1x1024,prefill:8192,engine-decode:1x1024,engine-prefill:8192 "
                        "(engine-*: the whole engine at its default step sizes; default: the full table)")
    p.add_argument("--profile", action="store_true", help="only where a decode step's time goes (matmuls, kernels by kind)")
    p.set_defaults(func=_cmd_bench_gpu)

    for bench in BENCHES:
        if not bench.parsed_in_cli:  # listed here; main hands their arguments over before argparse sees them
            sub.add_parser(bench.command, help=bench.help, add_help=False)
    sub.add_parser(PLOT_COMMAND, help="a bench's --json rows as a PNG: columns against a column, a line per group",
                   add_help=False)  # fmt: skip

    p = sub.add_parser("up", help="run the mesh on this machine: nats-server and every service")
    p.add_argument("--model", default=None, help="checkpoint folder (default: models/default, made if missing)")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--vision", type=int, default=0,
                   help="vision instances (E/P/D: they encode images for prefill and decode); 0: prefill encodes")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI API")
    p.add_argument("--state-dir", default=".infermesh", help="logs, traces, the kvcache LMDB and NATS data")
    p.add_argument("--demo", action="store_true", help="send one streaming chat, show its trace, then stop")
    p.add_argument("--planner", default="", metavar="PROFILE",
                   help="run the live planner on this stage profile (`infermesh profile`'s JSON): it scales the "
                        "prefill and decode instances for INFERMESH_PLANNER__* targets (ttft_ms, itl_ms, ...)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may ask for (vLLM's flag): the first is the one responses carry "
                        "(default: INFERMESH_BALANCER__MODEL_NAME, else the model folder's name)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="ranks (processes) per prefill and decode instance: EngineConfig.tensor_parallel_size "
                        "(default: INFERMESH_ENGINE__TENSOR_PARALLEL_SIZE, else 1)")  # fmt: skip
    p.add_argument("--data-parallel-size", type=int, default=None,
                   help="data-parallel attention ranks per instance (with --enable-expert-parallel, an MoE "
                        "model): EngineConfig.data_parallel_size; each instance is still one in the mesh")
    p.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="an MoE model's experts split over those ranks, attention and dense layers tensor-parallel "
                        "over them (DeepSeek-V4: its query heads; its KV whole on every rank): "
                        "EngineConfig.enable_expert_parallel (default: INFERMESH_ENGINE__ENABLE_EXPERT_PARALLEL)")
    p.add_argument("--enable-eplb", action=argparse.BooleanOptionalAction, default=None,
                   help="with --enable-expert-parallel, rebalance the experts over the ranks live: "
                        "EngineConfig.enable_eplb (default: INFERMESH_ENGINE__ENABLE_EPLB)")
    p.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='EPLB\'s settings, vLLM\'s keys: {"window_size": ..., "step_interval": ..., '
                        '"num_redundant_experts": ...}: EngineConfig.eplb_config (default: INFERMESH_ENGINE__EPLB_CONFIG)')
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser(
        "profile", help="measure each stage of a running mesh (start it with `infermesh up`) into a planner profile",
        description="A bounded sweep through the balancer's OpenAI API: prefill TTFT and uncached tokens/s against "
        "prompt length and concurrency, decode ITL and tokens/s against batch and context; writes the profile "
        "JSON (services/planner/profile.py), a plot beside it and, with --raw, every round.",
    )
    p.add_argument("--url", required=True, help="the balancer, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="the profile JSON to write (the plot goes beside it)")
    p.add_argument("--metrics-url", action="append", metavar="URL",
                   help="a worker's /metrics (repeat): its settings and KV bytes go into the profile")
    p.add_argument("--budget-s", type=float, default=600.0, help="time for the whole sweep: points that would not "
                   "fit are left out, interior first")
    p.add_argument("--prefill-lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048],
                   help="uncached prompt tokens (on a GPU go to 8192 and beyond)")
    p.add_argument("--prefill-concurrency", type=int, nargs="+", default=[1, 4], help="prompts in flight")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 2, 4, 8], help="streams decoding at once")
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[128, 1024],
                   help="mean tokens of KV each stream attends to (its prompt, then half its tokens)")
    p.add_argument("--decode-max-tokens", type=int, default=64, help="tokens each decode stream generates")
    p.add_argument("--vision-concurrency", type=int, nargs="*", default=[1, 2, 4, 8],
                   help="images in flight, one per chat (measured where the mesh has vision instances; none: skip)")
    p.add_argument("--vision-image-px", type=int, nargs="+", default=[224, 448],
                   help="the profiled images' sides (square), pixels: the grid is concurrency x size")
    p.add_argument("--kvcache-lengths", type=int, nargs="*", default=[512, 2048],
                   help="prompt tokens loaded back from kvcache after POST /reset_prefix_cache (needs a prefill "
                   "worker's --metrics-url; none: skip). It drops every instance's prefix cache: a mesh no one uses")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per point (after one warm-up round)")
    p.add_argument("--holdout", action="store_true",
                   help="also measure three points per stage off the grid, against the grid's interpolation")
    p.add_argument("--raw", default=None, help="the raw file: every point's rounds, held-out checks, load average")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--model-dir", default=None, help="the checkpoint, for KV bytes per token (default: the model id, "
                   "when it is a folder here)")
    p.add_argument("--device", default=None, help="the mesh's hardware in words (default: this machine's GPU or CPU)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default=None, help="said in the raw file and the profile (how the mesh was started, say)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("trace", help="print a request's spans as a waterfall")
    p.add_argument("which", nargs="?", default="last",
                   help="'last' (the last request), a request id, or a trace id (a prefix is enough)")
    p.add_argument("--trace-dir", default=None, help="default: the telemetry.trace_dir setting")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser("plan", help="replicas per stage, predicted latency and $/Mtok for a load, from a profile")
    p.add_argument("--profile", required=True, help="a profile file (infermesh profile writes one)")
    p.add_argument("--rps", type=float, required=True, help="requests per second")
    p.add_argument("--isl", type=float, required=True, help="mean input tokens per request")
    p.add_argument("--isl-p90", type=float, help="p90 input tokens (default: every request --isl)")
    p.add_argument("--osl", type=float, required=True, help="mean output tokens per request")
    p.add_argument("--osl-p90", type=float, help="p90 output tokens (default: every request --osl)")
    p.add_argument("--prefix-hit", type=float, default=0.0, help="share of input tokens already cached, 0..1")
    p.add_argument("--images-per-request", type=float, default=0.0)
    p.add_argument("--image-px", type=int, default=None,
                   help="the requests' image side, pixels: the encoder's figures are read at it, interpolated by "
                   "pixels between the profile's sizes (default: the largest size profiled)")
    p.add_argument("--ttft-ms", type=float, required=True, help="time-to-first-token target at --percentile")
    p.add_argument("--itl-ms", type=float, required=True, help="inter-token latency target at --percentile")
    p.add_argument("--percentile", type=float, default=90.0, help="the targets' percentile")
    p.add_argument("--gpu-hour-usd", type=float, required=True, help="price of one GPU-hour")
    p.add_argument("--values-out", help="write a Helm values file that deploys the plan here")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("config", help="print every setting, its env var and current value")
    p.set_defaults(func=_cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == PLOT_COMMAND:  # its flags are the module's, as a catalogued bench's
        from tools.bench.plot_rows import main as plot_main

        return plot_main(argv[1:])
    bench = find(argv[0]) if argv else None
    if bench is not None and not bench.parsed_in_cli:
        # Before argparse: a subparser cannot pass "--help" or leading flags through (REMAINDER stops at them).
        return _cmd_catalogued(bench, argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"infermesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
