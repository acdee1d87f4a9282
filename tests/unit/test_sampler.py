"""CPU unit tests of the sampler: exact where the result is deterministic,
fixed-seed frequency checks where it is a distribution."""

import math
from typing import Any

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from shared.engine.sampler import Sampler, SamplingState, _apply_penalties
from shared.engine.sampling_params import SamplingParams

VOCAB = 64


def state(
    prompt: list[int] | None = None, output: list[int] | None = None, eos: tuple[int, ...] = (), **kw: Any
) -> SamplingState:
    s = SamplingState.create(SamplingParams(**kw), prompt or [1, 2, 3], eos_token_ids=eos)
    s.output_token_ids.extend(output or [])
    return s


def frequencies(logits_row: torch.Tensor, num: int, **kw: Any) -> torch.Tensor:
    """Empirical token frequencies over `num` unseeded rows sampled in one batch."""
    # One state per row: a state's draws are keyed by (its seed, position), so rows
    # sharing one state at one position would all draw the same token.
    states = [state(**kw) for _ in range(num)]
    out = Sampler(seed=1)(logits_row.expand(num, -1).contiguous(), states)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel()).float() / num


def logits_of(probs: list[float], ids: list[int], vocab: int = 16) -> torch.Tensor:
    """Logits whose softmax puts probs[i] on ids[i] and nothing elsewhere (well, 1e-30)."""
    x = torch.full((vocab,), -100.0)
    x[ids] = torch.tensor(probs).log()
    return x


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1
    before = logits.clone()
    out = Sampler()(logits, [state(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)  # input untouched


def test_all_greedy_never_sorts(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("sorted on the greedy path")

    monkeypatch.setattr(torch.Tensor, "sort", boom)
    monkeypatch.setattr(torch, "sort", boom)
    logits = torch.randn(4, VOCAB)
    states = [state(temperature=0.0), state(temperature=0.0, repetition_penalty=1.3, output=[5])]
    Sampler()(logits[:2], states)
    assert _apply_penalties(logits, [state(temperature=0.0)] * 4) is logits  # no copy without penalties


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_matches_softmax(seeded: bool) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature, num = 0.7, 20000
    expected = (logits / temperature).softmax(-1)
    if seeded:
        states = [state(temperature=temperature, seed=1000 + i) for i in range(num)]
        out = Sampler()(logits.expand(num, -1).contiguous(), states)
        freq = torch.bincount(torch.tensor(out.token_ids), minlength=6).float() / num
    else:
        freq = frequencies(logits, num, temperature=temperature)
    # std of a frequency <= sqrt(0.25 / 20000) = 0.0035; 0.015 is > 4 sigma.
    assert (freq - expected).abs().max().item() < 0.015


def test_top_k_only_yields_top_k() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    top5 = set(logits.topk(5).indices.tolist())
    freq = frequencies(logits, 5000, temperature=2.0, top_k=5)
    assert set(freq.nonzero().flatten().tolist()) == top5


def test_top_p_keeps_the_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 on scattered ids, so sorting must map back correctly.
    logits = logits_of([0.15, 0.5, 0.05, 0.3], [2, 9, 4, 13])
    freq = frequencies(logits, 20000, top_p=0.75)  # 0.5 < 0.75 <= 0.8: nucleus {9, 13}
    assert set(freq.nonzero().flatten().tolist()) == {9, 13}
    assert abs(freq[9].item() - 0.5 / 0.8) < 0.015
    freq = frequencies(logits, 20000, top_p=0.85)  # 0.8 < 0.85 <= 0.95: adds id 2
    assert set(freq.nonzero().flatten().tolist()) == {2, 9, 13}
    freq = frequencies(logits, 2000, top_p=0.1)  # the top token always stays
    assert set(freq.nonzero().flatten().tolist()) == {9}


def test_top_k_and_top_p_together() -> None:
    logits = logits_of([0.15, 0.5, 0.05, 0.3], [2, 9, 4, 13])
    freq = frequencies(logits, 5000, top_k=3, top_p=0.99)  # top_p alone would keep all 4
    assert set(freq.nonzero().flatten().tolist()) == {2, 9, 13}


def test_min_p() -> None:
    logits = logits_of([0.15, 0.5, 0.05, 0.3], [2, 9, 4, 13])
    freq = frequencies(logits, 20000, min_p=0.2)  # floor 0.1 drops only id 4
    assert set(freq.nonzero().flatten().tolist()) == {2, 9, 13}
    assert abs(freq[9].item() - 0.5 / 0.95) < 0.015
    freq = frequencies(logits, 5000, min_p=0.5)  # floor 0.25
    assert set(freq.nonzero().flatten().tolist()) == {9, 13}


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    prompt, output = [3, 7, 7, 60, 1], [7, 11, 0]
    states = [state(prompt, output, repetition_penalty=1.7), state(prompt, output)]
    got = _apply_penalties(logits, states)
    ids = torch.tensor([prompt + output])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[:1].clone())
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], logits[1])  # the row without penalty is untouched


def test_presence_and_frequency_penalties() -> None:
    logits = torch.zeros(1, 8)
    s = state(prompt=[1, 2], output=[3, 3, 5], presence_penalty=0.5, frequency_penalty=0.25)
    got = _apply_penalties(logits, [s])
    expected = torch.zeros(1, 8)
    expected[0, 3] = -(0.5 + 2 * 0.25)
    expected[0, 5] = -(0.5 + 1 * 0.25)
    assert torch.equal(got, expected)  # prompt tokens 1, 2 are not penalised


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 1.0]])
    kw: dict[str, Any] = dict(temperature=0.0, min_tokens=3, stop_token_ids=[2], eos=(1,))
    assert Sampler()(logits, [state(output=[4, 4], **kw)]).token_ids == [3]
    assert Sampler()(logits, [state(output=[4, 4, 4], **kw)]).token_ids == [1]  # min_tokens reached
    masked = _apply_penalties(logits, [state(output=[4, 4], **kw)])
    assert masked[0].tolist() == [0.0, -math.inf, -math.inf, 7.0, 1.0]
    # ignore_eos: EOS cannot end the request, so only stop ids are held back.
    assert Sampler()(logits, [state(output=[], ignore_eos=True, **kw)]).token_ids == [1]


def test_logprobs_are_raw_with_rank_and_sorted_top() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7))
    states = [
        state(output=[5, 5], temperature=0.0, logprobs=5, repetition_penalty=2.0, presence_penalty=1.0),
        state(temperature=1.3, top_k=10, logprobs=0, seed=3),
        state(temperature=0.0),
    ]
    out = Sampler()(logits, states)
    raw = logits.log_softmax(-1)
    for i, k in [(0, 5), (1, 0)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == raw[i, lp.token_id].item()
        assert lp.rank == 1 + int((raw[i] > raw[i, lp.token_id]).sum())
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == raw[i].argsort(descending=True)[:k].tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert all(v == raw[i, t].item() for t, v in lp.top)
    assert out.logprobs[2] is None


def test_rank_reflects_sampled_token() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    s = state(prompt=[9], output=[0], temperature=0.0, logprobs=2, repetition_penalty=10.0)
    lp = Sampler()(logits, [s]).logprobs[0]
    assert lp is not None and lp.token_id == 1 and lp.rank == 2
    assert [t for t, _ in lp.top] == [0, 1]


def _run(states: list[SamplingState], row_of: list[int], steps: int, sampler: Sampler) -> list[list[int]]:
    """Decodes `steps` tokens for states placed at rows row_of[j]; logits depend only on
    (step, request) so a request sees the same logits wherever it sits in the batch."""
    for step in range(steps):
        logits = torch.empty(len(states), VOCAB)
        for j, s in enumerate(states):
            g = torch.Generator().manual_seed(10_000 * step + s.params.max_tokens)
            logits[row_of[j]] = torch.randn(VOCAB, generator=g) * 2
        ordered = [states[row_of.index(row)] for row in range(len(states))]
        out = sampler(logits, ordered)
        for j, s in enumerate(states):
            s.output_token_ids.append(out.token_ids[row_of[j]])
    return [s.output_token_ids for s in states]


def test_seeded_request_is_batch_invariant() -> None:
    # max_tokens doubles as a request id for the logits in _run.
    alone = _run([state(seed=42, max_tokens=100, top_p=0.9)], [0], 20, Sampler(seed=0))[0]
    others = [state(max_tokens=200 + i, temperature=0.8, top_k=20) for i in range(7)]
    target = state(seed=42, max_tokens=100, top_p=0.9)
    batched = _run(others + [target], [0, 1, 2, 4, 5, 6, 7, 3], 20, Sampler(seed=123))[7]
    assert batched == alone
    other_seed = _run([state(seed=43, max_tokens=100, top_p=0.9)], [0], 20, Sampler(seed=0))[0]
    assert other_seed != alone


def test_mixed_batch_equals_rows_alone() -> None:
    def make() -> list[SamplingState]:
        return [
            state(temperature=0.0, max_tokens=1),
            state(seed=7, temperature=0.9, top_k=12, min_p=0.05, max_tokens=2),
            state(temperature=1.0, max_tokens=3),  # unseeded: only checked for validity
            state(temperature=0.0, logprobs=3, repetition_penalty=1.5, max_tokens=4),
            state(seed=8, presence_penalty=0.7, frequency_penalty=0.4, top_p=0.8, logprobs=2, max_tokens=5),
            state(temperature=0.0, min_tokens=5, eos=(0, 1, 2), frequency_penalty=1.0, max_tokens=6),
            state(seed=9, temperature=0.5, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[4], max_tokens=7),
        ]

    batched = make()
    _run(batched, [6, 2, 0, 5, 1, 3, 4], 12, Sampler(seed=5))
    for j, s in enumerate(make()):
        alone = _run([s], [0], 12, Sampler(seed=99))[0]
        if s.params.greedy or s.params.seed is not None:
            assert alone == batched[j].output_token_ids, j
        assert all(0 <= t < VOCAB for t in batched[j].output_token_ids)
    # Same logprobs, too, alone or batched, for one step.
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    together = Sampler()(logits, make())
    for j, s in enumerate(make()):
        single = Sampler()(logits[j : j + 1], [s])
        if s.params.greedy or s.params.seed is not None:
            assert single.token_ids[0] == together.token_ids[j]
            assert single.logprobs[0] == together.logprobs[j]


def test_create_argument_order() -> None:
    s = SamplingState.create(SamplingParams(seed=5), [1, 2], [7])
    assert s.eos_token_ids == frozenset({7}) and s.output_token_ids == [] and s.seed == 5
    assert SamplingState.create(SamplingParams(), [1]).seed is None
    with pytest.raises(TypeError):
        SamplingState.create(SamplingParams(), [1], "cpu")  # type: ignore[arg-type]
