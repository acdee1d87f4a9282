"""V4's batched compressed attention (shared/model/compressed_batch.py) against the
per-sequence reference (compressed_attention.py through V4Attention._attend_sequence),
float32 on the CPU, on the tiny seeded checkpoints of test_deepseek_v4.py.

- the same varlen steps (a prefill of three prompts, chunks that split compression
  windows beside decode steps, decode steps) through two paged drivers, one model on
  each path: logits within 1e-5 and the compressed caches equal;
- a decode step with the metadata a CUDA graph gives (host lists at the capture's bound,
  lengths only in the tensors, a scratch slot, padding rows) equals the eager step:
  the path the graphs capture, checked here without a GPU;
- closing_rows finds exactly the closing rows without reading the device.

The indexer's top-k is taken over a batch-wide entry count here and per sequence in the
reference; torch's topk breaks exact ties by tensor length, so the checkpoints use enough
indexer heads that exact ties at the k-th entry do not occur on these prompts.
"""

from pathlib import Path

import pytest
import torch

from shared.model.compressed_batch import closing_rows
from shared.model.forward_batch import AttentionMetadata
from shared.model.loader import load_model
from shared.model.models.deepseek_v4 import DeepseekV4ForCausalLM
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import random_prompts
from tests.helpers.numerics import rel_err
from tests.helpers.paged_driver import GraphShapedPair, PagedDriver

pytest.importorskip("transformers")

TOLERANCE = 1e-5
PROMPT_LENS = (45, 62, 71)


def set_batched(model: DeepseekV4ForCausalLM, batched: bool) -> None:
    for layer in model.model.layers:
        layer.self_attn.batched = batched


@pytest.fixture(scope="module", params=["mixed", "hca_first", "csa_only"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DeepseekV4ForCausalLM:
    path: Path = save_tiny_v4(request.param, tmp_path_factory.mktemp(request.param), seed=1)
    loaded = load_model(path)
    assert isinstance(loaded, DeepseekV4ForCausalLM)
    return loaded


def run_both(model: DeepseekV4ForCausalLM, steps: list[dict[int, list[int]]], block_size: int) -> tuple[PagedDriver, PagedDriver]:
    """The steps through a reference driver and a batched one (same block order)."""
    drivers = {b: PagedDriver(model, 3, num_blocks=512, block_size=block_size, seed=5) for b in (False, True)}
    for k, step in enumerate(steps):
        outs = {}
        for batched, driver in drivers.items():
            set_batched(model, batched)
            outs[batched] = driver.step(step)
        set_batched(model, True)
        for s in step:
            assert rel_err(outs[True][s], outs[False][s]) < TOLERANCE, f"step {k}, sequence {s}"
    return drivers[False], drivers[True]


def compressed_caches(model: DeepseekV4ForCausalLM, driver: PagedDriver) -> list[torch.Tensor]:
    return [driver.kv_caches[c][0] for c in model._compressed_cache.values()]


@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_equals_the_per_sequence_reference(model: DeepseekV4ForCausalLM, block_size: int) -> None:
    prompts = random_prompts(list(PROMPT_LENS), 512, seed=3)
    tail = random_prompts([12, 12, 12], 512, seed=4)
    steps: list[dict[int, list[int]]] = [{0: prompts[0][:30], 1: prompts[1][:7]}]
    # Chunks of 5 tokens (never aligned to 4 or 16) beside single-token steps.
    steps.append({0: prompts[0][30:], 1: prompts[1][7:12], 2: prompts[2]})
    steps += [{0: [tail[0][k]], 1: prompts[1][12 + 5 * k : 17 + 5 * k], 2: [tail[2][k]]} for k in range(6)]
    steps += [{s: [tail[s][6 + k]] for s in range(3)} for k in range(6)]
    ref, batched = run_both(model, steps, block_size)
    for a, b in zip(compressed_caches(model, ref), compressed_caches(model, batched)):
        assert rel_err(b, a) < TOLERANCE


def test_a_graph_shaped_decode_step_equals_the_eager_one(model: DeepseekV4ForCausalLM) -> None:
    """Two drivers fed alike, then one decode step each: eager, and with graph-shaped
    metadata (the batch padded by 3 rows). Lengths crossing window ends on purpose."""
    set_batched(model, True)
    prompts = random_prompts([63, 47, 31], 512, seed=6)
    pair = GraphShapedPair(model, prompts, num_blocks=512, block_size=16, seed=7, bound=256, pad=3)
    for k in range(3):
        step = {s: [100 + k + s] for s in range(3)}
        eager, graphed = pair.step(step)
        for s in step:
            assert rel_err(graphed[s], eager[s]) < TOLERANCE, f"decode {k}, sequence {s}"
    assert pair.metas and all(m.scratch_slot is not None for m in pair.metas[0])
    for a, b in zip(compressed_caches(model, pair.eager), compressed_caches(model, pair.graphed)):
        # Equal everywhere but the scratch block, where the rows that closed nothing wrote.
        a, b = a.clone(), b.clone()
        a[pair.scratch] = b[pair.scratch] = 0
        assert rel_err(b, a) < TOLERANCE


def test_closing_rows_without_a_device_read() -> None:
    rate = 4
    # Three sequences: tokens 2..9 (closes 3, 7), one token at 11 (closes 11), 5..6 (none).
    positions = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 11, 5, 6])
    meta = AttentionMetadata(torch.zeros(11, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64), [0, 8, 9, 11], [10, 12, 7], 4)
    rows, live = closing_rows(positions, meta, rate)
    assert live is None and rows.tolist() == [1, 5, 8]
    meta.scratch_slot = 0
    rows, live = closing_rows(positions, meta, rate)
    assert rows.tolist() == list(range(11)) and live is not None
    assert live.nonzero().flatten().tolist() == [1, 5, 8]
