"""Deterministic sampling (issue 14, point 4): the noise of every draw is a pure
function of (seed, stream, position, token id), so a seeded request samples the
same tokens alone or in any batch, on any engine instance, with the overlapped
step loop, and with speculation on (its tokens equal those without speculation).

The distribution is checked with a chi-square test, and shown to fail for two
broken variants (a wrong noise transform, noise not keyed by position)."""


import pytest
import torch

import shared.engine.keyed_random as keyed_random
from shared.engine.keyed_random import Stream, keys_tensor, mix64, random_bits, row_key
from shared.engine.llm import LLM
from shared.engine.sampler import Sampler, SamplingState
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model
from tests.helpers.numerics import chi2_p_value_even_df

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("keyed")))


# -- the counter-based generator ---------------------------------------------------------


def test_random_bits_equal_the_pure_python_reference() -> None:
    # Keys of both signs, and the extremes: int64 wrap-around and the logical shifts
    # must reproduce unsigned 64-bit arithmetic bit for bit.
    keys = [row_key(s, p) for s, p in [(0, 0), (1, 5), (2**63 - 1, 10**9), (12345, 2**40)]]
    keys += [-(2**63), 2**63 - 1, -1, 0]
    got = random_bits(torch.tensor(keys, dtype=torch.int64), 300).tolist()
    golden = 0x9E3779B97F4A7C15
    for row, key in zip(got, keys):
        expected = [mix64(key + golden * (i + 1)) for i in range(300)]
        assert [b & ((1 << 64) - 1) for b in row] == expected


def test_keys_separate_seeds_positions_and_streams() -> None:
    keys = {row_key(s, p) for s in range(50) for p in range(50)}
    assert len(keys) == 2500
    assert row_key(3, 7, Stream.TOKEN) == row_key(3, 7)
    u = keyed_random.uniforms(keys_tensor(list(range(64)), [0] * 64, Stream.TOKEN, CPU), 4096)
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.002  # 262,144 draws: sd 0.00056


LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0])  # 7 tokens: 6 degrees of freedom
TEMPERATURE = 0.8


def _one_request_counts(num: int) -> torch.Tensor:
    """Token counts of one seeded request drawn at positions 0..num-1 (the way a
    request really consumes its randomness), batched 500 rows a call."""
    sampler = Sampler()
    counts = torch.zeros(LOGITS.numel())
    state = SamplingState.create(SamplingParams(temperature=TEMPERATURE, seed=2024), [1])
    for start in range(0, num, 500):
        rows = min(500, num - start)
        out = sampler(LOGITS.expand(rows, -1).contiguous(), [state] * rows, list(range(start, start + rows)))
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=LOGITS.numel()).float()
    return counts


def _p_value(counts: torch.Tensor) -> float:
    expected = (LOGITS / TEMPERATURE).softmax(-1) * counts.sum()
    return chi2_p_value_even_df(float(((counts - expected) ** 2 / expected).sum()), LOGITS.numel() - 1)


def test_sampled_tokens_follow_the_softmax_and_broken_noise_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _p_value(_one_request_counts(20000)) > 1e-3
    # Broken: uniform noise in the race instead of exponential (argmax p / u is not a sample of p).
    with monkeypatch.context() as m:
        m.setattr(keyed_random, "exponentials", keyed_random.uniforms)
        assert _p_value(_one_request_counts(20000)) < 1e-9
    # Broken: noise keyed by the seed alone, not the position: every draw is the same token.
    with monkeypatch.context() as m:
        m.setattr(keyed_random, "row_key", lambda seed, position, stream=Stream.TOKEN: mix64(seed) >> 1)
        counts = _one_request_counts(2000)
        assert counts.count_nonzero().item() == 1 and _p_value(counts) < 1e-9


def test_seeds_and_positions_give_independent_tokens() -> None:
    # Rows of many seeds at one position follow the softmax too (what a batch of n samples sees).
    states = [SamplingState.create(SamplingParams(temperature=TEMPERATURE, seed=s), [1]) for s in range(20000)]
    out = Sampler()(LOGITS.expand(20000, -1).contiguous(), states, [5] * 20000)
    assert _p_value(torch.bincount(torch.tensor(out.token_ids), minlength=LOGITS.numel()).float()) > 1e-3


# -- through the engine ------------------------------------------------------------------


def _seeded(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=987654321, ignore_eos=True, **kw)


def _others(num: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """A mix around the request: greedy, unseeded, other seeds, other lengths."""
    prompts = random_prompts([3 + 7 * i % 29 for i in range(num)], vocab=500, seed=40 + num)
    params = [
        SamplingParams(max_tokens=5 + i % 13, ignore_eos=True, temperature=[0.0, 1.0, 0.7][i % 3],
                       seed=None if i % 2 else i, top_k=[None, 20][i % 2])  # fmt: skip
        for i in range(num)
    ]
    return prompts, params


def test_seeded_request_same_alone_in_batches_and_on_another_engine(model: str) -> None:
    prompt = random_prompts([21], vocab=500, seed=3)[0]
    alone = LLM(model, seed=0).generate([prompt], _seeded())[0].token_ids
    assert len(set(alone)) > 3  # really sampled
    for size in (2, 5, 12):
        prompts, params = _others(size - 1)
        at = size // 2  # somewhere inside the batch
        prompts.insert(at, prompt)
        params.insert(at, _seeded())
        # Another engine (a restart), another engine seed, small blocks and chunked prefill.
        llm = LLM(model, seed=size, block_size=4, prefill_chunk_size=8, max_num_batched_tokens=40)
        assert llm.generate(prompts, params)[at].token_ids == alone, size
    other_seed = LLM(model).generate([prompt], SamplingParams(max_tokens=24, top_p=0.95, seed=1, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_overlapped_steps_draw_at_the_chunks_positions(model: str) -> None:
    # With async scheduling the runner samples step N+1 before step N's token is appended
    # to the request's state: the draws must still be keyed by the true position.
    prompt = random_prompts([13], vocab=500, seed=8)[0]
    sync = LLM(model, async_scheduling=False).generate([prompt], _seeded(20))[0].token_ids
    overlapped = LLM(model, async_scheduling=True).generate([prompt], _seeded(20))[0].token_ids
    assert overlapped == sync


def test_speculation_keeps_the_seeded_tokens(model: str) -> None:
    # The target as its own draft model proposes its argmax; at a low temperature the
    # draws often equal it (accepted), and sometimes not (a correction is drawn).
    prompts = random_prompts([5, 17, 9], vocab=500, seed=2)
    params = [SamplingParams(max_tokens=30, temperature=0.1, seed=11 + i, ignore_eos=True) for i in range(3)]
    plain = [o.token_ids for o in LLM(model).generate(prompts, params)]
    greedy = LLM(model).generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert plain != [o.token_ids for o in greedy]  # really sampled
    spec_llm = LLM(model, speculative="draft", spec_draft_model=model, spec_tokens=3)
    spec = [o.token_ids for o in spec_llm.generate(prompts, params)]
    load = spec_llm.engine.load()
    assert load.num_spec_drafted_tokens > 0 and load.num_spec_accepted_tokens > 0
    assert load.num_spec_accepted_tokens < load.num_spec_drafted_tokens  # some rejected: corrections drawn too
    assert spec == plain
