"""The rows a verify step hands to the CUDA graphs (issue 13), checked on the CPU.

On CUDA a step whose chunks are short (a decode, a verify step's last token and its
drafts, a draft model's catch-up) replays the decode graphs with one row per token
(ModelRunner._forward_graph): the chunk's block table on every row, row j at position
start + j with sequence length start + j + 1. The graphs themselves need a GPU
(tests/gpu/test_gpu_spec_graphs.py); here the same rows run eagerly as one-token
sequences through the model's own attention, so a wrong position, slot, length, table
or sample row changes the greedy tokens against the run without speculation."""

from pathlib import Path

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.model_runner import ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_inputs import fill_placeholders
from shared.model.forward_batch import AttentionMetadata

TRAINED_DIR = Path(__file__).resolve().parents[2] / "models" / "trained"
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 9, 13, 9, 13, 21] * 3, [7, 8, 7, 8, 7, 8, 11], [100, 200, 300, 400] * 2]


class RowsAsSequences:
    """Stands where DecodeGraphs stands (can_run, run), running the rows it is handed
    as one-token sequences, eagerly, and counting its calls."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.calls = 0

    def can_run(self, num_rows: int, max_blocks: int) -> bool:
        return True

    def run(self, input_ids, positions, slots, seq_lens, tables, placeholder_sources=None, last_tokens=None):
        self.calls += 1
        r, n = self.runner, len(input_ids)
        ids = torch.tensor(input_ids)
        if placeholder_sources is not None:
            ids = fill_placeholders(ids, torch.tensor(placeholder_sources), last_tokens)
        metas = []
        for g, group_slots in enumerate(slots):
            width = max(len(t) for t in tables[g])
            table = torch.tensor([t + [r.null_blocks[g]] * (width - len(t)) for t in tables[g]])
            metas.append(AttentionMetadata(
                slot_mapping=torch.tensor(group_slots), block_tables=table, query_start_loc=list(range(n + 1)),
                seq_lens=list(seq_lens), block_size=r.block_size,
                query_start_loc_tensor=torch.arange(n + 1, dtype=torch.int32),
                seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
            ))  # fmt: skip
        return r.model(ids, torch.tensor(positions), r.kv_caches, metas)


def _rows_instead_of_graphs(runner: ModelRunner, max_query: int) -> RowsAsSequences:
    runner.max_graph_query = max_query
    runner.graphs = RowsAsSequences(runner)  # type: ignore[assignment]
    return runner.graphs  # type: ignore[return-value]


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_verify_steps_as_rows_keep_the_greedy_tokens(drafter: str) -> None:
    target = str(TRAINED_DIR / "target")
    reference = [o.token_ids for o in LLM(target, max_num_seqs=4).generate(PROMPTS, PARAMS)]
    extra = {"spec_draft_model": str(TRAINED_DIR / "draft")} if drafter == "draft" else {}
    llm = LLM(target, max_num_seqs=4, speculative=drafter, spec_tokens=4, spec_schedule="fixed", **extra)
    rows = _rows_instead_of_graphs(llm.engine.runner, 5)
    draft_rows = None
    if drafter == "draft":
        draft_rows = _rows_instead_of_graphs(llm.engine.speculator.drafter.runner, 5)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    load = llm.engine.load()
    assert load.num_spec_verifications > 0 and rows.calls > 0
    assert (load.spec_fallbacks or {}).get("cuda_graphs", 0) == 0
    assert draft_rows is None or draft_rows.calls > 0


def test_block_tables_fill_every_row_and_zero_the_rest() -> None:
    """The graph's staging tables: each row's blocks, then zeros (a stale block id past
    a row's length would be read by no kernel, but a stale table is a bug waiting)."""
    import torch

    from shared.engine.cuda_graphs import fill_block_tables

    table = torch.full((2, 5, 4), 99, dtype=torch.int64)
    groups = [[[3], [4, 5, 6, 7], [], [8, 9]], [[1, 2], [1, 2], [1, 2, 3], [0]]]
    fill_block_tables(table[:, :4], groups)
    for g, rows in enumerate(groups):
        for i, row in enumerate(rows):
            assert table[g, i].tolist() == row + [0] * (4 - len(row))
    assert table[:, 4].eq(99).all()  # rows past the step's are not touched
