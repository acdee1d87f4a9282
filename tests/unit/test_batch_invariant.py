"""Batch-invariant mode (issue 14, point 3; the MoE families, issue 28) on the CPU: one request's logprobs
(logprobs=5) bitwise equal alone and inside batches of 2, 7, 16 and 64 requests of
mixed lengths, with chunked prefill, a prefix hit and speculating neighbours; and the same comparison FAILS
in the normal mode (so the test can fail), as does the normal linear at op level."""

import pytest
import torch
import torch.nn.functional as F

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.model.batch_invariant import InvariantNorm, invariant_linear
from shared.model.kept_weights import KeptFormats
from shared.model.loader import load_model
from tests.helpers.engine_helpers import generate
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

TARGET = random_prompts([37], vocab=500, seed=77)[0]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
CHUNKED = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=64)
"""The batched engines: small blocks, prompts prefilled in chunks of 8 beside decodes."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("bi")))


def test_ops_give_a_row_the_same_bits_in_any_batch() -> None:
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(70, 64, generator=g)
    full = invariant_linear(x, w, b)
    for start, num in [(0, 1), (5, 1), (3, 16), (9, 17), (40, 30)]:
        assert torch.equal(invariant_linear(x[start : start + num], w, b), full[start : start + num])
    # The normal path is not invariant on this CPU (GEMV for one row, GEMM for 70).
    assert not all(torch.equal(F.linear(x[i : i + 1], w, b)[0], F.linear(x, w, b)[i]) for i in range(70))
    normed = InvariantNorm.rms_norm(x, torch.ones(64), 1e-6)
    assert all(torch.equal(InvariantNorm.rms_norm(x[i : i + 1], torch.ones(64), 1e-6)[0], normed[i]) for i in range(70))


def _alone(model: str, invariant: bool):  # noqa: ANN202
    out = LLM(model, batch_invariant=invariant).generate([TARGET], PARAMS)[0]
    return out.token_ids, out.logprobs


def _in_batch(model: str, invariant: bool, size: int):  # noqa: ANN202
    llm = LLM(model, batch_invariant=invariant, **CHUNKED)
    llm.generate([TARGET[:24]], SamplingParams(max_tokens=1, temperature=0.0))  # cached: the target hits 24 tokens
    prompts = random_prompts([1 + (11 * i) % 50 for i in range(size - 1)], vocab=500, seed=size)
    params = [SamplingParams(max_tokens=2 + i % 9, temperature=0.0, ignore_eos=True) for i in range(size - 1)]
    at = size // 3
    prompts.insert(at, TARGET)
    params.insert(at, PARAMS)
    out = llm.generate(prompts, params)[at]
    assert out.num_cached_tokens == 24
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("size", [2, 7, 16, 64])
def test_logprobs_bitwise_equal_alone_and_in_a_batch(model: str, size: int) -> None:
    alone = _alone(model, invariant=True)
    assert alone[1] and len(alone[1][0].top) == 5
    # Another reduction order, the same function: close to the normal mode's numbers.
    normal = _alone(model, invariant=False)
    assert alone[0] == normal[0]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(alone[1], normal[1]))
    assert _in_batch(model, True, size) == alone


def test_the_build_chooses_the_table_and_an_engine_keeps_it(model: str) -> None:
    built = load_model(model, batch_invariant=True)
    plain = load_model(model)
    assert built.batch_invariant and built.model.layers[0].self_attn.qkv_proj._gemv is invariant_linear
    assert not plain.batch_invariant and plain.model.layers[0].self_attn.qkv_proj._gemv is not invariant_linear
    # A model built by the caller runs the table it was built with, as one the engine loads itself.
    out, logprobs = generate(LLMEngine(EngineConfig(model="(in memory)", batch_invariant=True), built), "a", TARGET, PARAMS)
    assert (out.token_ids, logprobs) == _alone(model, invariant=True)
    # The engine swaps no table: a config that asks for the other one is refused.
    with pytest.raises(ValueError, match="built with batch_invariant=False"):
        LLMEngine(EngineConfig(model="(in memory)", batch_invariant=True), plain)
    with pytest.raises(ValueError, match="built with batch_invariant=True"):
        LLMEngine(EngineConfig(model="(in memory)"), built)
    # Kept quantised weights would bring their own kernels after the build.
    with pytest.raises(ValueError, match="float weights only"):
        load_model(model, keep=KeptFormats(fp8=True), batch_invariant=True)


def test_the_normal_mode_is_not_invariant(model: str) -> None:
    alone = _alone(model, invariant=False)
    assert any(_in_batch(model, False, size) != alone for size in (7, 64))


def test_logprobs_bitwise_equal_while_the_batch_speculates(model: str) -> None:
    """Speculation on: the other requests of the batch draft by prompt lookup and are
    verified in multi-token chunks beside the target (which asks for logprobs: it may
    draft too, its logprobs then read from its verify rows). Its logprobs stay those it has alone, and a
    greedy request that speculates itself keeps its tokens alone."""
    alone = _alone(model, invariant=True)
    spec = dict(speculative="ngram", spec_tokens=3, spec_schedule="fixed")
    llm = LLM(model, batch_invariant=True, **CHUNKED, **spec)
    # Repetitive prompts: prompt lookup finds drafts in them.
    prompts = [[5 + i, 9, 13, 9, 13, 9, 13, 21] * 3 for i in range(7)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]
    outs = llm.generate([*prompts[:3], TARGET, *prompts[3:]], [*params[:3], PARAMS, *params[3:]])
    assert (outs[3].token_ids, outs[3].logprobs) == alone
    load = llm.engine.load()
    assert load.num_spec_verifications > 0 and "logprobs" not in (load.spec_fallbacks or {})
    speculated = outs[0].token_ids
    assert LLM(model, batch_invariant=True).generate([prompts[0]], params[0])[0].token_ids == speculated


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param)))


def test_moe_logprobs_bitwise_equal_alone_and_in_a_batch(moe_model: str) -> None:
    """The MoE families (issue 28): routers and experts take the invariant kernels too
    (batch_invariant.InvariantExperts), so a request's logprobs do not depend on which
    tokens share its experts."""
    alone = _alone(moe_model, invariant=True)
    normal = _alone(moe_model, invariant=False)
    assert alone[0] == normal[0]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(alone[1], normal[1]))
    assert _in_batch(moe_model, True, 16) == alone
