"""Tensor parallelism over real gloo processes on the CPU, against one process.

The logits of N ranks equal the single-process logits within float32 rounding, not
bitwise: o_proj and down_proj sum their inputs in N partial sums joined by an
all-reduce, a different summation order from one matmul's. Each such reordering moves
a float32 sum by a few ulps of its terms; through three layers and the head that stays
near 1e-6 of logits of size ~1.5 (measured: at most 9e-7), so the bound is
1e-5 * max|logit|, ten times that. The embedding (one non-zero row summed with zeros)
and the gathered head are exact, and every rank holds bitwise the same logits (an
all-gather is a copy), which is why every rank samples the same tokens.
"""

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from shared.engine.executor.multiproc import WorkerFailed
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model
from tests.helpers.tensor_parallel import Steps, paged_logits, tensor_parallel_logits

pytest.importorskip("transformers")

BOUND = 1e-5
"""max|TP - single| / max|single| (the module docstring says why)."""

PROMPT_LENS = [5, 13, 22]  # 22 spans 6 blocks of 4 and passes qwen2's window of 6


def _steps(seed: int) -> Steps:
    """A varlen prefill of three prompts, then four batched decode steps."""
    prompts = random_prompts(PROMPT_LENS, vocab=500, seed=seed)
    decode = random_prompts([len(prompts)] * 4, vocab=500, seed=seed + 1)
    return [dict(enumerate(prompts))] + [{s: [token] for s, token in enumerate(step)} for step in decode]


def _check_against_one_rank(path: Path, steps: Steps, ranks: list[list[dict[int, torch.Tensor]]]) -> None:
    reference = paged_logits(path, steps)
    for ref_step, *rank_steps in zip(reference, *ranks):
        for seq, ref in ref_step.items():
            for logits in rank_steps:
                assert torch.equal(logits[seq], rank_steps[0][seq])  # every rank: the same numbers
            err = ((rank_steps[0][seq] - ref).abs().max() / ref.abs().max()).item()
            assert err < BOUND, f"{path.name}: relative error {err:.2e} over {BOUND:.0e}"


def test_two_ranks_give_the_logits_of_one(tmp_path: Path) -> None:
    """Llama (GQA 4:2, llama3 rope) with a vocabulary of 509, which two ranks split as
    255 + 254 and a padding row; Qwen3 with one KV head, replicated on both ranks, and
    per-head q/k norms; Mistral with a sliding window on every layer."""
    cases = [
        (save_tiny_hf_model("llama", tmp_path / "llama", seed=1, vocab_size=509), _steps(2)),
        (save_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=1), _steps(4)),
        (save_tiny_hf_model("mistral", tmp_path / "mistral", seed=1), _steps(6)),
    ]
    for (path, steps), ranks in zip(cases, tensor_parallel_logits(cases, world_size=2)):
        _check_against_one_rank(path, steps, ranks)


def test_four_ranks_give_the_logits_of_one(tmp_path: Path) -> None:
    """Qwen2: biases on q/k/v, tied embeddings (the head is the vocab-parallel embedding),
    hybrid sliding layers; two KV heads over four ranks (each replicated twice)."""
    path = save_tiny_hf_model("qwen2", tmp_path / "qwen2", seed=1)
    steps = _steps(8)
    (ranks,) = tensor_parallel_logits([(path, steps)], world_size=4)
    _check_against_one_rank(path, steps, ranks)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("tp-llama"), seed=3))


ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
"""Small blocks and chunks: prompts span blocks, prefill is chunked beside decoding."""


def test_the_engine_over_two_ranks_generates_the_tokens_of_one(llama: str) -> None:
    """Greedy and seeded sampled requests through LLM.generate, overlapped steps (launch /
    collect on every rank; while the min_tokens and bad-words request runs, launch /
    collect / sample: its masks wait for the read-back on every rank); the workers exit 0
    when the engine closes."""
    prompts = random_prompts([5, 17, 33, 9], vocab=500, seed=1)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, seed=3, min_tokens=5, stop_token_ids=[7, 8, 9],
                       bad_words_token_ids=[[5], [6, 7]]),
    ]
    prompts.append(prompts[0])
    expected = [o.token_ids for o in LLM(llama, **ENGINE).generate(prompts, params)]
    llm = LLM(llama, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    workers = list(llm.engine.executor._workers)  # type: ignore[attr-defined]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.load().steps.sampled_after_read_back > 0
    assert llm.engine.runner.kv_caches[0].shape[-2] == 1  # rank 0's cache holds its one KV head of two
    llm.engine.close()
    assert [w.exitcode for w in workers] == [0]


def test_heads_that_do_not_divide_are_refused_before_any_rank_starts(llama: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(llama, tensor_parallel_size=3)
    # Three KV heads over two ranks: neither splits nor replicates evenly.
    odd = save_tiny_hf_model("llama", tmp_path / "odd", num_attention_heads=6, num_key_value_heads=3,
                             hidden_size=96, head_dim=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"must divide num_key_value_heads \(3\) or be a multiple of it"):
        LLM(str(odd), tensor_parallel_size=2)
    moe = save_tiny_hf_model("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ValueError, match=r"not implemented yet: tensor parallelism for Qwen3MoeForCausalLM"):
        LLM(str(moe), tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_a_worker_killed_mid_run_fails_the_engine_within_seconds(llama: str) -> None:
    llm = LLM(llama, tensor_parallel_size=2, **ENGINE)
    (worker,) = llm.engine.executor._workers  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts([8], vocab=500, seed=5), SamplingParams(max_tokens=2))  # both ranks warm
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker rank 1 .*exit code -9"):
        llm.generate(random_prompts([20, 30, 40], vocab=500, seed=6), params)
    assert time.monotonic() - start < 10.0
    # Closed by the failure: the engine refuses further steps rather than hanging on them.
    with pytest.raises(WorkerFailed):
        llm.engine.executor.execute(None)  # type: ignore[arg-type]
