"""DeepSeek-V4's decode replayed from CUDA graphs equals V4's eager decode (issue 27,
point 2; run on the device machine: `python -m pytest -q --noconftest
tests/gpu/test_gpu_v4_graphs.py`). Self-contained: the checkpoint is make-model's tiny V4
(written by the project, no transformers needed), with a window of 16 so that the state
cache drops blocks within a short run; CSA every 4 tokens and HCA every 128, prompts
placed so that decode steps close windows of both (127, 255: HCA entries emitted inside
the graph).

- the graphed engine captured graphs for V4 (supports_cuda_graphs on the Triton table)
  and every decode step replayed one (no eager fallback);
- float32, 7 prompts (the graph of 8 runs a padding row): the graphed run follows the
  eager one token for token, logprobs and top-5 within 1e-4 (the same kernels; only the
  padded batch and the gathers' bound, max_model_len // rate, differ), on at least 90 %
  of the tokens;
- bfloat16, 8 prompts (no padding): the same within 0.1, on at least half the tokens.

The random tiny model's logits are flat (top two ~0.02 apart), so a rounding may flip a
greedy choice: where the two runs part, the graphed run's token must be a near-tie in the
eager run's top-5 (within the tolerance), and the comparison of that prompt stops there.
A graph replaying wrong inputs parts from eager at its first decode step, by far more.
"""

from pathlib import Path

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.graphed_engines import cuda_llm, record_replays
from tools.make_model import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT_LENS = (3, 17, 64, 100, 127, 200, 255, 90)
NEW_TOKENS = 40
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4_tiny")
    make_model(path, arch="deepseek_v4", preset="tiny", seed=3, tokenizer=False, sliding_window=16)
    return path


def prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS[:count]]


def engine(path: Path, dtype: str, cuda_graphs: bool) -> LLM:
    return cuda_llm(path, dtype, cuda_graphs, block_size=16, max_model_len=512)


def run_both(path: Path, dtype: str, count: int) -> tuple[list, list, list[int]]:
    eager = engine(path, dtype, cuda_graphs=False)
    assert eager.engine.runner.graphs is None
    ps = prompts(eager.engine.model.config.vocab_size, count)
    want = eager.generate(ps, PARAMS)
    eager.engine.close()
    del eager
    torch.cuda.empty_cache()
    graphed = engine(path, dtype, cuda_graphs=True)
    assert graphed.engine.model.supports_cuda_graphs
    rows = record_replays(graphed.engine.runner.graphs)
    got = graphed.generate(ps, PARAMS)
    return want, got, rows


def follow(got: list, want: list, tolerance: float) -> int:
    """Tokens on which the graphed outputs follow the eager ones (see the module's doc)."""
    agreed = 0
    for k, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a.logprobs, b.logprobs):
            if x.token_id != y.token_id:
                theirs = dict(y.top)
                assert x.token_id in theirs and y.logprob - theirs[x.token_id] < tolerance, (
                    f"prompt {k}: graphed token {x.token_id} is no near-tie of eager's {y.token_id}")
                break  # the sequences part here
            assert abs(x.logprob - y.logprob) < tolerance, f"prompt {k}: logprob off by {abs(x.logprob - y.logprob):.2e}"
            for u, v in zip(x.top, y.top):
                assert abs(u[1] - v[1]) < tolerance, f"prompt {k}: top logprobs off by {abs(u[1] - v[1]):.2e}"
            agreed += 1
    return agreed


def test_graphed_v4_decode_equals_eager_float32(checkpoint: Path) -> None:
    want, got, rows = run_both(checkpoint, "float32", 7)
    # All prompts prefill together, then NEW_TOKENS - 1 decode steps, each replayed.
    assert len(rows) >= NEW_TOKENS - 1, f"only {len(rows)} replays"
    agreed = follow(got, want, 1e-4)
    assert agreed >= 0.9 * 7 * NEW_TOKENS, f"graphed and eager agree on only {agreed} tokens"


def test_graphed_v4_decode_follows_eager_bfloat16(checkpoint: Path) -> None:
    want, got, rows = run_both(checkpoint, "bfloat16", 8)
    assert len(rows) >= NEW_TOKENS - 1
    agreed = follow(got, want, 0.1)
    assert agreed >= 0.5 * 8 * NEW_TOKENS, f"graphed and eager agree on only {agreed} tokens"
