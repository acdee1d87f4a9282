"""A decode graph's replay hands its inputs over without waiting for the device, at every
bucket (run on the device machine: `python -m pytest -q tests/gpu`).

Overlapped scheduling prepares step N+1 on the host while the device runs step N; the
replay's inputs therefore travel in one copy from a pinned staging buffer. Laid out with
the largest bucket's stride, the rows of a smaller bucket were a strided view of it,
which torch copies through a pageable temporary, and a copy from pageable memory waits
for the device: every step below the largest bucket (all of a speculating engine's
plain steps) lost the overlap. Checked by queueing ~0.1 s of device work first and
timing the host's side of a replay."""

import time
from pathlib import Path

import pytest
import torch

from shared.engine.llm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TRAINED = Path(__file__).resolve().parents[2] / "models" / "trained"


def test_a_replay_below_the_largest_bucket_does_not_wait_for_the_device():
    llm = LLM(str(TRAINED / "target"), dtype="float32", device="cuda", max_num_seqs=64)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.buckets[-1] == 64
    groups = graphs.num_groups
    for b in (1, 3, 16, 64):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time queued ahead of the replay
        start = time.perf_counter()
        graphs.run(
            input_ids=[1] * b, positions=[0] * b, slots=[[graphs.scratch_slots[g]] * b for g in range(groups)],
            seq_lens=[0] * b, tables=[[[] for _ in range(b)] for _ in range(groups)],
        )  # fmt: skip
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        waited = time.perf_counter() - start
        assert waited > 0.05, "the device work queued ahead was too short to tell"
        assert host < 0.02, f"batch {b}: the replay's host side took {host * 1e3:.1f} ms (waited for the device)"
