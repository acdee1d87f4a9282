"""Expert parallelism (issue 28) against one process, in real processes: four ranks
spawned on a gloo group over 127.0.0.1 run the MoE blocks of Qwen3-MoE, GPT-OSS and
DeepSeek-V4 (a hash-routed and a top-k layer) with the tokens split over the ranks as
data-parallel attention splits them (one rank with none), over 2 and 4 ranks, on the
static placement and on an EPLB placement with redundant experts. Each rank's output
equals the single-process block's rows for its tokens: bitwise in batch-invariant mode
(float32 and bfloat16), within DEFAULT_TOLERANCE otherwise; the ranks' per-expert
counts sum to the single process's. A placement switch mid-run (weights moved between
the ranks) gives the same outputs before and after. Cases: tests/helpers/expert_parallel_cases.py."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shared.model.moe import sum_over_choices
from tests.helpers.expert_parallel_cases import (
    CASES,
    SWITCH_FAMILIES,
    Case,
    local_range,
    moe_block,
    slot_experts,
    tokens,
    worker,
)
from tools.launch.up import free_port

WORLD = 4
DEFAULT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
"""float32, default mode: the experts' matmuls see other row counts on a rank (BLAS picks
its kernel and reduction order by shape), and the k choices add in choice order rather
than the reference's expert order. Measured here: at most 1.2e-6 absolute (never 0)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("expert_parallel")
    mp.spawn(worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True)
    return out


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process block's output for all the tokens, and its counts."""
    block = moe_block(case.family, case.dtype, case.invariant)
    x, input_ids = tokens(case.family, case.dtype)
    with torch.inference_mode():
        out = block(x, input_ids)
    assert block.counts is not None
    return out, block.counts


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_expert_parallel_equals_one_process(results: Path, case: Case) -> None:
    expected, expected_counts = reference(case)
    counts = torch.zeros_like(expected_counts)
    for rank in range(case.world):
        got = torch.load(results / f"{case.name}-{rank}.pt")
        mine = expected[local_range(case.world, rank)]
        assert got["out"].shape == mine.shape and got["out"].dtype == mine.dtype
        if case.invariant:
            assert torch.equal(got["out"], mine), f"rank {rank}: max diff {(got['out'] - mine).abs().max()}"
        else:
            torch.testing.assert_close(got["out"], mine, **DEFAULT_TOLERANCE)
        counts += got["counts"]
    assert torch.equal(counts, expected_counts)
    assert expected.abs().max() > 0.1  # the experts did contribute


def test_eplb_placement_has_replicas_and_ranks_split_the_tokens() -> None:
    """The EPLB cases exercise what they claim: some expert on several slots; every rank's
    token range, together, is the batch."""
    for world in (2, 4):
        slots = slot_experts(world, "eplb")
        assert len(slots) == 8 + world and torch.bincount(slots, minlength=8).max() > 1
        assert sorted(range(21)) == [t for r in range(world) for t in range(21)[local_range(world, r)]]


@pytest.mark.parametrize("family", SWITCH_FAMILIES)
def test_placement_switch_mid_run_keeps_outputs(results: Path, family: str) -> None:
    expected, _ = reference(Case(family, True, WORLD, "static"))
    for rank in range(WORLD):
        got = torch.load(results / f"switch-{family}-{rank}.pt")
        assert bool(got["moved_weights_match"]), f"rank {rank}: moved experts differ from the full copy's"
        mine = expected[local_range(WORLD, rank)]
        assert torch.equal(got["before"], mine) and torch.equal(got["after"], mine)


def test_sum_over_choices_adds_in_choice_order() -> None:
    """Choice order, one add at a time: ((a + b) + c), which differs from (a + (b + c)) here."""
    a, b, c = torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([1e-8])
    per_choice = torch.stack([a, b, c], dim=1)  # [1, 3, 1]
    assert torch.equal(sum_over_choices(per_choice), (a + b) + c)
    assert not torch.equal((a + b) + c, a + (b + c))
