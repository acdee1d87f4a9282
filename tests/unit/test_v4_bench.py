"""tools/bench/v4_bench.py on the CPU with make-model's tiny V4 (the H200 runs it on the
v4-flash-8l preset): it runs end to end, counts the decode window's tokens exactly,
its times are positive and the kinds of a step sum to no more than the step; kernels
count in the range that launched them, Triton's (no op to hang off, run after the range
closed on the host) by the range's GPU-side annotation; and the v4-flash-8l preset is
V4-Flash's layout at the scale its docstring says."""

import json
import math

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

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


# -- the GPU side of the accounting (no GPU here) ----------------------------------------
# Profiler events as torch lists them (FunctionEvent), times on one clock in microseconds:
# host ops carry their correlation id; a kernel carries the id of the op it hangs off
# (linked_correlation_id), or 0 where the launch was inside no torch op (Triton's, from
# Python inside a record_function range), and runs later, on the GPU, where each range
# also has its annotation: a span over the kernels launched while it was open.

STREAM = 7


def _op(id: int, name: str, start: float, end: float, parent: FunctionEvent | None = None) -> FunctionEvent:
    ev = FunctionEvent(id=id, name=name, thread=1, start_us=start, end_us=end, is_user_annotation=name in KINDS)
    if parent is not None:
        ev.set_cpu_parent(parent)
    return ev


def _kernel(id: int, name: str, start: float, end: float, launched_by: FunctionEvent | None) -> FunctionEvent:
    linked = 0 if launched_by is None else launched_by.id
    if launched_by is not None:
        launched_by.append_kernel(name, 0, end - start)  # as torch hangs a linked kernel off its op
    return FunctionEvent(id=id, name=name, thread=0, start_us=start, end_us=end, device_type=DeviceType.CUDA,
                         device_resource_id=STREAM, linked_correlation_id=linked)  # fmt: skip


def _annotation(name: str, start: float, end: float, range_op: FunctionEvent) -> FunctionEvent:
    range_op.append_kernel(name, 0, end - start)  # torch lists it as a "kernel" of the host range
    return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=DeviceType.CUDA,
                         device_resource_id=STREAM, is_user_annotation=True)  # fmt: skip


def test_kernels_count_under_the_innermost_range_that_launched_them() -> None:
    attention = _op(1, "v4.attention", 0.0, 100.0)
    mm = _op(2, "aten::mm", 5.0, 15.0, attention)
    core = _op(3, "v4.attention.core", 20.0, 80.0, attention)
    indexer = _op(4, "v4.indexer", 25.0, 45.0, core)
    topk = _op(5, "aten::topk", 30.0, 35.0, indexer)
    softmax = _op(6, "aten::softmax", 50.0, 58.0, core)
    logits = _op(7, "aten::linear", 110.0, 119.0)  # outside every range
    device = [_kernel(11, "gemm", 200.0, 207.0, mm), _kernel(12, "topk_kernel", 207.0, 210.0, topk),
              _kernel(13, "softmax_kernel", 210.0, 214.0, softmax), _kernel(14, "lm_head_gemm", 214.0, 220.0, logits),
              _annotation("v4.attention", 200.0, 214.0, attention),
              _annotation("v4.attention.core", 207.0, 214.0, core), _annotation("v4.indexer", 207.0, 210.0, indexer)]  # fmt: skip
    a = attribute([attention, mm, core, indexer, topk, softmax, logits, *device])
    assert (a.kernels_us["v4.attention"], a.kernels_us["v4.attention.core"], a.kernels_us["v4.indexer"]) == (7.0, 4.0, 3.0)
    assert a.kernels_total_us == 20.0  # the annotations are not work; the outside 6 us is the total less the ranges'
    assert (a.host_us["v4.attention"], a.host_us["v4.attention.core"], a.host_us["v4.indexer"]) == (40.0, 40.0, 20.0)
    assert a.by_kernel_us == {"gemm": 7.0, "topk_kernel": 3.0, "softmax_kernel": 4.0, "lm_head_gemm": 6.0}


def test_triton_kernels_count_in_the_range_that_launched_them_though_they_run_after_it() -> None:
    """The H100 run of 2026-12-06 (docs/perf/h100/v4_bench_2026-12-06.json): the fused
    MoE's _gate_up_kernel and _down_kernel, launched inside moe.experts with no torch op
    around them, hang off no op and run after the range has closed on the host; and an mHC
    whose one kernel is Triton's. They count in their ranges, not outside the layers."""
    moe = _op(1, "v4.moe", 100.0, 200.0)
    counts = _op(2, "aten::zeros", 102.0, 105.0, moe)
    experts = _op(3, "moe.experts", 110.0, 170.0, moe)
    sort = _op(4, "aten::sort", 112.0, 120.0, experts)
    total = _op(5, "aten::sum", 150.0, 160.0, experts)
    mhc = _op(6, "v4.mhc", 200.0, 215.0)
    lm_head = _op(7, "aten::linear", 220.0, 230.0)
    # The driver's launch calls (Triton's), on the OS thread: no op of theirs, and their
    # ids are the driver's, one of which is also an op's (4, aten::sort's).
    launches = [FunctionEvent(id=i, name="cuLaunchKernelEx", thread=4242, start_us=t, end_us=t + 3)
                for i, t in ((4, 125.0), (9, 140.0), (10, 205.0))]  # fmt: skip
    device = [
        _kernel(20, "fill_kernel", 395.0, 398.0, counts),
        _kernel(21, "radixSort", 400.0, 410.0, sort),
        _kernel(4, "_gate_up_kernel", 410.0, 450.0, None),
        _kernel(9, "_down_kernel", 450.0, 500.0, None),
        _kernel(22, "reduce_kernel", 500.0, 505.0, total),
        _kernel(10, "_hyper_connection_kernel", 505.0, 520.0, None),
        _kernel(23, "lm_head_gemm", 520.0, 530.0, lm_head),
        _annotation("v4.moe", 395.0, 505.0, moe),
        _annotation("moe.experts", 400.0, 505.0, experts),
        _annotation("v4.mhc", 505.0, 520.0, mhc),
    ]
    a = attribute([moe, counts, experts, sort, total, mhc, lm_head, *launches, *device])
    assert experts.time_range.end < 410.0  # the Triton kernels ran after moe.experts closed on the host
    assert a.kernels_us["moe.experts"] == 10.0 + 40.0 + 50.0 + 5.0
    assert a.kernels_us["v4.moe"] == 3.0
    assert a.kernels_us["v4.mhc"] == 15.0
    assert a.kernels_total_us == 133.0  # outside: the LM head's 10 us alone
    assert sum(a.kernels_us.values()) == 123.0
    assert (a.host_us["v4.moe"], a.host_us["moe.experts"], a.host_us["v4.mhc"]) == (40.0, 60.0, 15.0)


def test_a_kernel_in_no_range_and_in_no_annotation_is_outside() -> None:
    experts = _op(1, "moe.experts", 0.0, 10.0)
    mm = _op(2, "aten::mm", 1.0, 2.0, experts)
    late = _kernel(5, "_down_kernel", 50.0, 60.0, None)  # no op, and after the range's span on the GPU
    a = attribute([experts, mm, _kernel(6, "gemm", 20.0, 30.0, mm), _annotation("moe.experts", 20.0, 30.0, experts), late])
    assert a.kernels_us["moe.experts"] == 10.0 and a.kernels_total_us == 20.0


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
