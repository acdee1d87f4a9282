"""Speculative decoding's steps on CUDA graphs (issue 13; run on the device machine:
`python -m pytest -q tests/gpu`): a verify step (each request's last token and its
drafts) replays the decode graphs with one row per token, and so do the draft model's
single-token passes and short catch-ups. Checked on the trained default pair in
float32: the graphed run's greedy tokens equal the eager run's and the run without
speculation, every verify step was graphed (no "cuda_graphs" fallback), verify steps
replayed more rows than requests, and the draft model replayed graphs."""

from pathlib import Path

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.graphed_engines import cuda_llm, record_replays

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TRAINED = Path(__file__).resolve().parents[2] / "models" / "trained"
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(4, 40, (n,), generator=g)]


def engine(cuda_graphs: bool, speculative: bool) -> LLM:
    knobs = dict(speculative="draft", spec_draft_model=str(TRAINED / "draft"), spec_tokens=4, spec_schedule="fixed")
    return cuda_llm(TRAINED / "target", "float32", cuda_graphs, **(knobs if speculative else {}))


def test_verify_steps_replay_graphs_and_keep_greedy_tokens():
    plain = engine(cuda_graphs=True, speculative=False)
    ps = prompts(plain.engine.model.config.vocab_size)
    reference = [o.token_ids for o in plain.generate(ps, PARAMS)]
    eager = engine(cuda_graphs=False, speculative=True)
    graphed = engine(cuda_graphs=True, speculative=True)
    # Every bucket is captured at start: count the rows each replay was handed instead.
    target_rows = record_replays(graphed.engine.runner.graphs)
    drafter = graphed.engine.speculator.drafter
    assert drafter.runner.graphs is not None
    draft_rows = record_replays(drafter.runner.graphs)
    eager_tokens = [o.token_ids for o in eager.generate(ps, PARAMS)]
    graphed_tokens = [o.token_ids for o in graphed.generate(ps, PARAMS)]
    assert eager_tokens == reference
    assert graphed_tokens == reference
    load = graphed.engine.load()
    assert load.num_spec_verifications > 0
    assert (load.spec_fallbacks or {}).get("cuda_graphs", 0) == 0, load.spec_fallbacks
    # Rows of more than one token per request were replayed, and the draft model replayed too.
    assert max(target_rows) > len(ps), target_rows
    assert draft_rows


def test_verify_graph_hidden_states_equal_eager_rows():
    """One verify-shaped step through both paths of the same runner: the graph's rows
    equal the eager forward's (float32, within kernel rounding)."""
    from shared.engine.step import ScheduledChunk, SchedulerOutput

    llm = engine(cuda_graphs=True, speculative=True)
    runner = llm.engine.runner

    # Two sequences of 37 and 21 cached tokens (written by a real prefill), then a step of
    # 1 + 3 and 1 + 1 tokens: the last token and its drafts.
    ps = prompts(llm.engine.model.config.vocab_size, n=2, seed=1)
    ps = [(ps[0] * 4)[:37], (ps[1] * 4)[:21]]
    blocks = [[list(range(0, 4))], [list(range(4, 7))]]
    sched = SchedulerOutput(chunks=[ScheduledChunk(f"s{i}", p, 0, b, sample=False) for i, (p, b) in enumerate(zip(ps, blocks))])
    with torch.inference_mode():
        runner._forward(sched)
        step = [ScheduledChunk("s0", [5, 6, 7, 8], 37, blocks[0], sample=False),
                ScheduledChunk("s1", [9, 10], 21, blocks[1], sample=False)]  # fmt: skip
        graphed, _, _ = runner._forward(SchedulerOutput(chunks=step))
        assert runner.last_step_graphed
        graphed = graphed.clone()
        graphs, runner.graphs = runner.graphs, None
        eager, _, _ = runner._forward(SchedulerOutput(chunks=step))
        runner.graphs = graphs
    assert graphed.shape == eager.shape == (6, eager.shape[1])
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
