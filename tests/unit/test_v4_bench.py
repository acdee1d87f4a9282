"""tools/bench/v4_bench.py on the CPU with make-model's tiny V4 (the H200 runs it on the
v4-flash-8l preset): it runs end to end, counts the decode window's tokens exactly,
its times are positive and the kinds of a step sum to no more than the step; and the
v4-flash-8l preset is V4-Flash's layout at the scale its docstring says."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from shared.model.config import ModelConfig
from tools.make_model import PRESETS, hf_config_dict, make_model
from shared.model.models import build_model
from tools.bench.v4_bench import KINDS, OUTSIDE, attribute, run_v4_bench

BATCHES = (1, 2)
NUM_STEPS = 2
PROMPT_LEN = 24


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("v4")
    make_model(folder / "model", arch="deepseek_v4", preset="tiny", seed=0, tokenizer=False)
    # One thread: the tiny V4's ops are too small to share, and on a loaded host
    # OpenMP's spinning threads make each of its thousands of ops 10-50x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_v4_bench(
            str(folder / "model"), str(folder / "out"), "cpu", "float32", BATCHES, context=12, num_steps=NUM_STEPS,
            prompt_len=PROMPT_LEN, repeats=1, num_profiled=1,
        ) | {"out": folder / "out"}  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def test_decode_counts_every_token_of_its_window(record: dict) -> None:
    assert [d["batch"] for d in record["decode"]] == list(BATCHES)
    for d in record["decode"]:
        assert d["num_steps"] == NUM_STEPS
        assert d["num_tokens"] == d["batch"] * NUM_STEPS
        assert d["seconds"] > 0
        assert d["tok_s"] == pytest.approx(d["num_tokens"] / d["seconds"])


def test_prefill_is_the_prompt_over_its_ttft(record: dict) -> None:
    p = record["prefill"]
    assert p["prompt_len"] == PROMPT_LEN and len(p["ttft_s"]) == 1 and p["ttft_s"][0] > 0
    assert p["tok_s"] == pytest.approx(PROMPT_LEN / p["ttft_s"][0])


def test_kinds_are_positive_and_sum_to_the_step(record: dict) -> None:
    breakdowns = [d["breakdown"] for d in record["decode"]] + [record["prefill"]["breakdown"]]
    for b in breakdowns:
        assert b["device_ms"] is None  # no GPU: host time only
        host = b["host_ms"]
        assert list(host) == [*KINDS, OUTSIDE]
        # Every kind of work a V4 step does ran under its range (the tiny V4 has CSA
        # layers with entries past 4 tokens, so its indexer scores too).
        for kind in ("v4.attention", "v4.attention.core", "v4.compressor", "v4.indexer", "moe.router", "moe.experts",
                     "moe.shared_experts", "v4.mhc", "v4.norm"):  # fmt: skip
            assert host[kind] > 0, kind
        assert all(v >= -1e-3 for v in host.values()), host  # exclusive times: nested ranges taken out once
        assert sum(host[k] for k in KINDS) <= b["host_total_ms"] + 1e-6
        assert sum(host.values()) == pytest.approx(b["host_total_ms"])


def test_mode_figures_and_files(record: dict) -> None:
    assert record["mode"] == "eager" and record["graphs_replayed"] is False
    f = record["figures"]
    config = ModelConfig.from_pretrained(record["model"])
    model = build_model(config, device="meta")
    weights = [t for t in model.parameters() if t.is_floating_point()]
    assert f["params"] == sum(t.numel() for t in weights)
    # 8 experts of which 2 per token: the routed experts count a quarter.
    routed = sum(t.numel() for name, t in model.named_parameters() if ".mlp.experts." in name)
    assert f["active_params"] == f["params"] - routed * 3 / 4
    # float32, head_dim 64, index keys 32: 2 CSA layers (64 + 32) / 4, 1 HCA layer 64 / 128.
    assert f["kv_logical_bytes_per_token"] == pytest.approx(4 * (2 * 96 / 4 + 64 / 128))
    # Each compressed group its own row (no padding to the widest): two CSA caches of
    # 64 + 32 channels, one HCA cache of 64, a row per raw token, float32.
    assert f["kv_pool_bytes_per_token"] == 4 * (96 + 96 + 64)
    table = (record["out"] / "v4_bench.md").read_text()
    assert "eager" in table and "| decode, batch 2, context ~12 (eager) |" in table
    assert not any(d["graphed"] for d in record["decode"])
    assert json.loads((record["out"] / "v4_bench.json").read_text())["decode"][1]["num_tokens"] == 2 * NUM_STEPS


def _event(name: str, parent: SimpleNamespace | None, cpu_us: float, kernels: list[tuple[str, float]] = ()) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, cpu_time_total=cpu_us,
                           kernels=[SimpleNamespace(name=n, duration=d) for n, d in kernels])  # fmt: skip


def _kernel(name: str, us: float, annotation: bool = False) -> SimpleNamespace:
    span = SimpleNamespace(elapsed_us=lambda: us)
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=span, is_user_annotation=annotation)


def test_kernels_count_under_the_innermost_range_that_launched_them() -> None:
    """The GPU side of the accounting (no GPU here): profiler events as torch lists
    them, kernels hanging off the CPU op that launched them."""
    attention = _event("v4.attention", None, 100.0, [("v4.attention", 90.0)])  # its GPU annotation: not work
    mm = _event("aten::mm", attention, 10.0, [("gemm", 7.0)])
    core = _event("v4.attention.core", attention, 60.0)
    indexer = _event("v4.indexer", core, 20.0)
    topk = _event("aten::topk", indexer, 5.0, [("topk_kernel", 3.0)])
    softmax = _event("aten::softmax", core, 8.0, [("softmax_kernel", 4.0)])
    logits = _event("aten::linear", None, 9.0, [("lm_head_gemm", 6.0)])  # outside every range
    device = [_kernel("gemm", 7.0), _kernel("topk_kernel", 3.0), _kernel("softmax_kernel", 4.0),
              _kernel("lm_head_gemm", 6.0), _kernel("v4.attention", 90.0, annotation=True)]  # fmt: skip
    a = attribute([attention, mm, core, indexer, topk, softmax, logits, *device])
    assert (a.kernels_us["v4.attention"], a.kernels_us["v4.attention.core"], a.kernels_us["v4.indexer"]) == (7.0, 4.0, 3.0)
    assert a.kernels_total_us == 20.0  # the outside 6 us is the total less the ranges'
    assert (a.host_us["v4.attention"], a.host_us["v4.attention.core"], a.host_us["v4.indexer"]) == (40.0, 40.0, 20.0)
    assert a.by_kernel_us == {"gemm": 7.0, "topk_kernel": 3.0, "softmax_kernel": 4.0, "lm_head_gemm": 6.0}


def test_v4_flash_8l_is_v4_flash_scaled() -> None:
    transformers = pytest.importorskip("transformers")
    d = hf_config_dict("deepseek_v4", PRESETS["v4-flash-8l"], "bfloat16", None, None)
    ours = transformers.DeepseekV4Config(**{k: v for k, v in d.items() if k not in ("architectures", "transformers_version")})
    real = transformers.DeepseekV4Config()
    same = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok", "n_shared_experts", "scoring_func",
            "routed_scaling_factor", "compress_rates", "compress_rope_theta", "rope_theta", "hc_mult",
            "hc_sinkhorn_iters", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
            "index_head_dim", "index_topk")  # fmt: skip
    assert {k: getattr(ours, k) for k in same} == {k: getattr(real, k) for k in same}
    assert (ours.num_hidden_layers, ours.n_routed_experts) == (8, 64)
    s, c, h = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    assert ours.layer_types == [s, s, c, h, c, h, c, h]
    assert ours.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 5
    assert ours.rope_parameters["compress"]["factor"] == 16.0
    model = build_model(ModelConfig.from_dict(d), device="meta")
    params = sum(t.numel() for t in model.parameters() if t.is_floating_point())
    assert math.isclose(params / 1e9, 15.08, abs_tol=0.01)
    with pytest.raises(ValueError, match="use arch 'deepseek_v4'"):
        make_model("/nonexistent/never-written", arch="llama", preset="v4-flash-8l")
