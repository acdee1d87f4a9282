"""The `infermesh` command as a user runs it."""

import dataclasses
import json
import os
import subprocess
import sys

from tests.helpers.hf_models import check_cli_generate_equals_hf, infermesh, random_prompts, save_tiny_hf_model


def test_generate_json_equals_transformers_greedy_on_a_transformers_checkpoint(tmp_path):
    save_tiny_hf_model("qwen2", tmp_path)  # saved by transformers alone: no tokenizer
    prompts = random_prompts([7, 19], vocab=500, seed=11)
    records = check_cli_generate_equals_hf(tmp_path, prompts, 32)
    assert all(set(r) == {"text", "token_ids", "prompt_token_ids", "finish_reason"} for r in records)


def test_make_model_then_chat_generation_with_sampling(tmp_path):
    model = tmp_path / "m"
    assert infermesh("make-model", str(model)).returncode == 0
    args = ["generate", "--model", str(model), "--chat", "--prompt", "Hi 🦙", "--prompt", "你好",
            "--max-tokens", "8", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json", "--ignore-eos"]
    first, second = infermesh(*args), infermesh(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout  # seeded: the same tokens every run
    records = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(records) == 2 and all(len(r["token_ids"]) == 8 and r["finish_reason"] == "length" for r in records)
    assert "Loading weights" in first.stderr  # the progress bar


def test_engine_flags_are_the_config_fields_and_only_given_ones_count():
    from shared.engine.config import EngineConfig
    from tools.cli import build_parser, engine_flags

    base = ["generate", "--model", "m", "--prompt", "x"]
    args = build_parser().parse_args(base)
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert {k.removeprefix("engine_") for k in vars(args) if k.startswith("engine_")} == names
    assert engine_flags(args) == {}  # nothing given: every knob keeps EngineConfig's default
    args = build_parser().parse_args(base + ["--seed", "5", "--engine-seed", "3", "--block-size", "8",
                                             "--no-cuda-graphs", "--kernels", "torch", "--max-model-len", "64"])
    assert args.seed == 5  # generate's own --seed samples; the engine's is --engine-seed
    assert engine_flags(args) == {"seed": 3, "block_size": 8, "cuda_graphs": False, "kernels": "torch", "max_model_len": 64}


def test_clear_errors_for_bad_input(tmp_path):
    out = infermesh("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert out.returncode == 2 and "infermesh: error:" in out.stderr
    assert "Traceback" not in out.stderr


def test_config_lists_the_trust_settings_and_never_prints_a_secret():
    secrets = {"INFERMESH_NATS__PASSWORD": "pNatsSecret1", "INFERMESH_WORKER__GRPC_TOKEN": "pGrpcSecret2",
               "INFERMESH_BALANCER__API_KEY": "pApiSecret3"}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INFERMESH_")}, **secrets,
           "INFERMESH_NATS__USER": "balancer"}
    out = subprocess.run([sys.executable, "-m", "tools.cli", "config"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    for line in ("user = 'balancer'    (INFERMESH_NATS__USER)", "bind_host = '127.0.0.1'    (INFERMESH_WORKER__BIND_HOST)",
                 "password = '<secret>'    (INFERMESH_NATS__PASSWORD)",
                 "grpc_token = '<secret>'    (INFERMESH_WORKER__GRPC_TOKEN)",
                 "api_key = '<secret>'    (INFERMESH_BALANCER__API_KEY)"):
        assert line in out.stdout, line
    assert not any(s in out.stdout + out.stderr for s in secrets.values())


def test_trace_picks_the_last_request_not_a_health_check():
    """`infermesh trace last` shows the last request's trace, though a health probe's
    span (a trace of its own, no request) started later; a request id picks its trace."""
    from tools.launch.trace_view import pick_trace

    def span(trace, name, start, parent=None, **attrs):  # noqa: ANN001, ANN202
        return {"trace_id": trace, "span_id": f"{trace}-{name}", "parent_id": parent, "name": name,
                "start_ns": start, "end_ns": start + 10, "attributes": attrs}

    spans = [
        span("aaaa", "POST /v1/completions", 100, **{"request.id": "cmpl-a"}),
        span("aaaa", "prefill", 105, parent="aaaa-POST /v1/completions", **{"request.id": "cmpl-a"}),
        span("bbbb", "POST /v1/chat/completions", 200, **{"request.id": "chatcmpl-b"}),
        span("cccc", "/grpc.health.v1.Health/Check", 300),
    ]
    assert {s["trace_id"] for s in pick_trace(spans, "last")} == {"bbbb"}
    assert [s["name"] for s in pick_trace(spans, "cmpl-a")] == ["POST /v1/completions", "prefill"]
    assert {s["trace_id"] for s in pick_trace(spans, "cc")} == {"cccc"}  # a trace id still works
