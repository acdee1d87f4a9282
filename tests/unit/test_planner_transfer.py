"""The KV handoff in the planner: the sweep's handoff rate is the decode workers' KV
bytes over the seconds their loads took, and plan() adds the percentile prompt's
handoff to the predicted TTFT (taking it out of prefill's budget), naming it when the
handoff alone leaves no time."""

import dataclasses
import math

import pytest

from services.planner.plan import InfeasibleTarget, Lengths, Targets, Workload, plan
from services.planner.plan_text import describe
from services.planner.stage_model import StageModels
from tools.planner.sweep import _handoff_gb_s
from tools.planner.synthetic_profile import KV_BYTES_PER_TOKEN, synthetic_profile

WORKLOAD = Workload(40.0, Lengths(2000, 4000), Lengths(200, 400))
TARGETS = Targets(ttft_ms=600, itl_ms=30)


def with_handoff(gb_s: float | None):  # noqa: ANN201
    profile = synthetic_profile()
    return dataclasses.replace(profile, transfer=dataclasses.replace(profile.transfer, handoff_gb_s=gb_s))


def test_the_handoff_adds_the_percentile_prompts_kv_at_the_measured_rate() -> None:
    without = plan(with_handoff(None), WORKLOAD, TARGETS, 2.0)
    assert without.handoff_ms == 0 and any("handoff time not in the profile" in n for n in without.notes)
    planned = plan(with_handoff(5.0), WORKLOAD, TARGETS, 2.0)
    expected_ms = 4000 * KV_BYTES_PER_TOKEN / 5e9 * 1e3  # the p90 prompt's KV at 5 GB/s: 104.9 ms
    assert planned.handoff_ms == pytest.approx(expected_ms)
    assert planned.predicted_ttft_ms == pytest.approx(planned.prefill.ttft_ms + planned.kv_load_ms + expected_ms)
    assert planned.predicted_ttft_ms <= TARGETS.ttft_ms
    # Prefill's budget shrinks by the handoff: its operating point is the best that fits what is left.
    chosen = StageModels.from_profile(with_handoff(5.0)).prefill.max_load(4000, 2000, TARGETS.ttft_ms - expected_ms)
    assert chosen is not None and planned.replicas["prefill"] == math.ceil(40.0 * 2000 / chosen.tokens_per_s)
    assert "handoff 104.9 ms" in describe(planned, TARGETS, 2.0)


def test_a_handoff_that_alone_takes_the_ttft_target_is_named() -> None:
    with pytest.raises(InfeasibleTarget, match="ms handoff") as info:
        plan(with_handoff(0.5), WORKLOAD, TARGETS, 2.0)  # 4000 tokens x 128 KiB at 0.5 GB/s: 1049 ms
    assert info.value.stage == "prefill" and info.value.best_ms > 1000


def _decode(bytes_: float, seconds: float) -> dict:
    return {("infermesh_decode_kv_transfer_bytes_total", frozenset({("path", "peer")})): bytes_,
            ("infermesh_decode_kv_transfer_seconds_total", frozenset({("path", "peer")})): seconds,
            ("infermesh_prefill_kv_transfer_bytes_total", frozenset({("path", "kvcache")})): 9e12}


def test_the_sweeps_handoff_rate_is_the_decode_workers_bytes_over_their_seconds() -> None:
    before, after = {"d": _decode(1e9, 1.0), "p": {}}, {"d": _decode(7e9, 4.0), "p": {}}
    assert _handoff_gb_s(before, after) == pytest.approx(2.0)  # 6 GB in 3 s; prefill's loads are not handoffs
    assert _handoff_gb_s(before, before) is None
