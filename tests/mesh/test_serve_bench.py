"""`infermesh bench`: the figures' arithmetic exactly, the load shapes and
workloads, then real runs: against the OpenAI API over an in-process engine
(LocalServer, a child process) and against a mesh started separately, through
the command line, checking what the server saw against what the bench reports."""

import json
import math
import subprocess
import sys

import httpx
import pytest

from tests.helpers.metrics import sample, scrape
from tools.bench.openai_stream import RequestResult
from tools.bench.serve_bench import LoadLevel, Slo, api_base, arrival_gaps, summarize
from tools.bench.workloads import WorkloadConfig, make_sessions

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(ttft: float, e2e: float, n_out: int, itl: list[float], n_in: int = 10, ok: bool = True) -> RequestResult:
    return RequestResult(ok, 0.0, ttft_s=ttft, e2e_s=e2e, itl_s=itl, num_prompt_tokens=n_in, num_output_tokens=n_out,
                         num_counted_tokens=n_out, num_usage_tokens=n_out, error="" if ok else "HTTP 500: boom")


def test_summary_is_vllm_bench_serves_arithmetic():
    results = [
        result(0.100, 0.500, 5, [0.1, 0.1, 0.1, 0.1]),  # TPOT (500 - 100) / 4 = 100 ms
        result(0.300, 0.600, 4, [0.1, 0.1, 0.1]),  # TPOT 100 ms
        result(0.200, 0.200, 1, []),  # one token: no TPOT
        result(0.0, 0.0, 0, [], ok=False),
    ]
    f = summarize(results, duration_s=2.0, peak_concurrency=3, percentiles=[50, 99], slo=Slo(ttft_ms=250))
    assert (f["completed"], f["failed"], f["max_concurrency"]) == (3, 1, 3)
    assert (f["total_input_tokens"], f["total_output_tokens"]) == (30, 10)
    assert f["request_throughput"] == 1.5 and f["output_throughput"] == 5.0 and f["total_token_throughput"] == 20.0
    assert f["request_goodput"] == 1.0  # two of three under 250 ms TTFT, over 2 s
    assert f["mean_ttft_ms"] == pytest.approx(200.0) and f["median_ttft_ms"] == pytest.approx(200.0)
    assert f["p99_ttft_ms"] == pytest.approx(298.0)
    assert f["mean_tpot_ms"] == pytest.approx(100.0) and f["std_tpot_ms"] == pytest.approx(0.0)
    assert f["mean_itl_ms"] == pytest.approx(100.0)  # seven gaps
    assert f["median_e2el_ms"] == pytest.approx(500.0)
    assert f["errors"] == ["HTTP 500: boom"]
    assert summarize(results, 2.0, 3)["request_goodput"] is None  # no SLO given


def test_slos_load_levels_and_urls_are_checked():
    assert Slo.parse(["ttft:500", "e2el:2000"]) == Slo(ttft_ms=500, e2el_ms=2000)
    with pytest.raises(ValueError, match="ttft:MS"):
        Slo.parse(["latency:5"])
    with pytest.raises(ValueError, match="milliseconds"):
        Slo.parse(["tpot:fast"])
    with pytest.raises(ValueError, match="either"):
        LoadLevel(concurrency=2, request_rate=1.0)
    with pytest.raises(ValueError, match="burstiness"):
        LoadLevel(request_rate=1.0, burstiness=0)
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"


def test_arrivals_are_seeded_gamma_with_the_rate_asked():
    gaps = arrival_gaps(10.0, 1.0, 4000, seed=3)
    assert gaps == arrival_gaps(10.0, 1.0, 4000, seed=3)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)
    bursty = arrival_gaps(10.0, 0.25, 4000, seed=3)
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.1)
    cv = lambda xs: math.sqrt(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)) / (sum(xs) / len(xs))  # noqa: E731
    assert cv(bursty) > 1.5 > cv(gaps) > 0.8  # Poisson: cv 1; gamma shape 0.25: cv 2
    assert arrival_gaps(math.inf, 1.0, 3, seed=0) == [0.0, 0.0, 0.0]


def test_workloads():
    shared = make_sessions(WorkloadConfig("shared-prefix", input_len=5, prefix_len=20, num_prefixes=2), 4, seed=1)
    prompts = [s.turns[0]([]).prompt for s in shared]
    assert all(len(p) == 25 for p in prompts)
    assert prompts[0][:20] == prompts[2][:20] != prompts[1][:20] == prompts[3][:20]
    assert prompts[0][20:] != prompts[2][20:]
    random = make_sessions(WorkloadConfig("random", input_len=50, range_ratio=0.5), 20, seed=1)
    lengths = {len(s.turns[0]([]).prompt) for s in random}
    assert len(lengths) > 5 and min(lengths) >= 25 and max(lengths) <= 75
    assert [s.turns[0]([]).prompt for s in random] == [s.turns[0]([]).prompt for s in make_sessions(
        WorkloadConfig("random", input_len=50, range_ratio=0.5), 20, seed=1)]
    chat = make_sessions(WorkloadConfig("multi-turn", input_len=4, turns=3), 1)[0]
    third = chat.turns[2](["first answer", "second answer"]).messages
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert [third[1]["content"], third[3]["content"]] == ["first answer", "second answer"]
    assert all(len(m["content"].split()) == 4 for m in third if m["role"] == "user")
    with pytest.raises(ValueError, match="workload"):
        WorkloadConfig("sharegpt")


def test_the_command_line_refuses_bad_load_flags_in_one_line():
    for args, message in (
        (["--request-rate", "fast"], "a rate is requests per second or 'inf', not 'fast'"),
        (["--request-rate", "0"], "a rate must be positive"),
        (["--concurrency", "2", "--request-rate", "1"], "not allowed with argument"),
        ([], "give --concurrency (closed loop) or --request-rate (open loop)"),
        (["--concurrency", "0"], "concurrency must be at least 1"),
        (["--concurrency", "1", "--goodput", "ttft=5"], "--goodput takes ttft:MS"),
    ):
        out = bench_cli("--base-url", "http://127.0.0.1:9", *args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


# -- real runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_api(tmp_path_factory):
    from shared.engine.config import EngineConfig
    from tools.make_model import make_model
    from tools.bench.local_server import LocalServer

    path = tmp_path_factory.mktemp("bench-local")
    make_model(path / "m")
    server = LocalServer(EngineConfig(model=str(path / "m"), max_model_len=1024), path / "local.log")
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


def bench_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def check_outputs(out, num_levels: int) -> dict:
    report = json.loads((out / "bench.json").read_text())
    assert len(report["levels"]) == num_levels
    for name in ("latency_cdf.png", "throughput_vs_load.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    return report


def test_closed_loop_against_the_in_process_server(local_api, tmp_path):
    out = bench_cli("--base-url", local_api.removesuffix("/v1"), "--concurrency", "1", "3", "--num-prompts", "6",
                    "--input-len", "24", "--output-len", "5", "--goodput", "e2el:600000", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = check_outputs(tmp_path, 2)
    for level, conc in zip(report["levels"], (1, 3)):
        f = level["figures"]
        assert level["level"]["concurrency"] == conc and f["max_concurrency"] == conc
        assert (f["completed"], f["failed"]) == (6, 0)
        assert (f["total_input_tokens"], f["total_output_tokens"]) == (6 * 24, 6 * 5)  # ignore_eos: every token
        assert f["request_goodput"] == pytest.approx(f["request_throughput"])  # 10 minutes: every request meets it
        assert f["median_ttft_ms"] > 0 and f["mean_e2el_ms"] > f["mean_ttft_ms"]
        assert len(level["samples_ms"]["ttft"]) == 6 and len(level["samples_ms"]["tpot"]) == 6
        assert {f"p{p}_{n}_ms" for p in (50, 90, 99) for n in ("ttft", "tpot", "itl", "e2el")} <= set(f)
    assert "concurrency 3: 6 ok, 0 failed" in out.stdout


def test_open_loop_multi_turn_sends_every_turn_with_its_history(local_api, tmp_path):
    out = bench_cli("--base-url", local_api, "--request-rate", "20", "inf", "--max-concurrency", "2",
                    "--workload", "multi-turn", "--turns", "2", "--num-prompts", "3", "--input-len", "6",
                    "--output-len", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = check_outputs(tmp_path, 2)
    for level in report["levels"]:
        f = level["figures"]
        assert (f["completed"], f["failed"]) == (6, 0) and f["max_concurrency"] <= 2
    assert report["levels"][1]["level"]["request_rate"] == math.inf


def test_a_server_that_refuses_counts_failures_and_exits_1(local_api, tmp_path):
    out = bench_cli("--base-url", local_api, "--model", "no-such-model", "--concurrency", "2", "--num-prompts", "3",
                    "--input-len", "8", "--output-len", "2", "--warmup", "0", "--out", str(tmp_path))
    assert out.returncode == 1
    f = json.loads((tmp_path / "bench.json").read_text())["levels"][0]["figures"]
    assert (f["completed"], f["failed"]) == (0, 3) and "HTTP 404" in f["errors"][0]


MESH = dict(num_prefill=1, num_decode=1, extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16"})
MESH_SHARED = True  # shares the session's mesh of this MESH (conftest.py's `mesh`): its assertions hold on a used one


def test_against_a_mesh_started_separately(mesh, tmp_path):
    balancer = mesh.api_url.removesuffix("/v1") + "/metrics"
    before = scrape(balancer)
    out = bench_cli("--base-url", mesh.api_url.removesuffix("/v1"), "--workload", "shared-prefix", "--prefix-len", "48",
                    "--num-prefixes", "2", "--concurrency", "2", "4", "--num-prompts", "8", "--input-len", "8",
                    "--output-len", "4", "--warmup", "0", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = check_outputs(tmp_path, 2)
    assert report["config"]["model"] == httpx.get(mesh.api_url + "/models").json()["data"][0]["id"]
    assert all(level["figures"]["completed"] == 8 for level in report["levels"])
    # What the mesh counted is what the bench sent.
    after = scrape(balancer)
    grew = lambda name, **labels: sample(after, name, **labels) - sample(before, name, **labels)  # noqa: E731
    assert grew("vllm:request_success_total", finished_reason="length") == 16
    assert grew("vllm:generation_tokens_total") == sum(lv["figures"]["total_output_tokens"] for lv in report["levels"])
    assert grew("vllm:prompt_tokens_total") == sum(lv["figures"]["total_input_tokens"] for lv in report["levels"])
