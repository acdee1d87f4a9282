"""allowed_token_ids, bad words and logit_bias in the sampler: exact on the CPU."""

import pytest
import torch

from shared.engine.logit_constraints import apply_constraints, banned_by_bad_words
from shared.engine.sampler import Sampler, SamplingState
from shared.engine.sampling_params import SamplingParams
from shared.stage.convert import params_from_proto, params_to_proto

VOCAB = 32


def state(output: list[int] | None = None, **kw: object) -> SamplingState:
    s = SamplingState.create(SamplingParams(**kw), [1, 2, 3])  # type: ignore[arg-type]
    s.output_token_ids.extend(output or [])
    return s


def test_allowed_token_ids_limit_greedy_and_sampled_tokens() -> None:
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0))
    allowed = [3, 17, 30]
    greedy = Sampler()(logits, [state(temperature=0.0, allowed_token_ids=allowed)] * 64)
    assert greedy.token_ids == [allowed[i] for i in logits[:, allowed].argmax(-1).tolist()]
    sampled = Sampler(seed=1)(logits, [state(temperature=1.0, allowed_token_ids=allowed)] * 64)
    assert set(sampled.token_ids) == set(allowed)  # 64 draws over three tokens: each is seen


def test_logit_bias_moves_the_argmax_and_leaves_logprobs_raw() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 5.0
    out = Sampler()(logits, [state(temperature=0.0, logit_bias={9: 6.0}, logprobs=0), state(temperature=0.0)])
    assert out.token_ids == [9, 4]
    raw = logits[0].log_softmax(-1)
    assert out.logprobs[0] is not None and out.logprobs[0].logprob == pytest.approx(raw[9].item())
    banned = Sampler()(logits[:1], [state(temperature=0.0, logit_bias={4: -100.0})])
    assert banned.token_ids == [0]  # every other logit ties at 0: the lowest id


def test_bad_words_ban_the_word_s_last_token_only_after_its_prefix() -> None:
    assert banned_by_bad_words([[7], [5, 6, 8]], []) == {7}
    assert banned_by_bad_words([[7], [5, 6, 8]], [1, 5, 6]) == {7, 8}
    assert banned_by_bad_words([[5, 6, 8]], [5, 6, 2]) == set()
    logits = torch.zeros(2, VOCAB)
    logits[:, 8] = 3.0
    logits[:, 7] = 2.0
    words = [[5, 6, 8]]
    out = Sampler()(logits, [state([5, 6], temperature=0.0, bad_words_token_ids=words),
                             state([6, 5], temperature=0.0, bad_words_token_ids=words)])
    assert out.token_ids == [7, 8]


def test_no_constraint_no_copy_and_input_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_constraints(logits, [state()] * 3) is logits
    before = logits.clone()
    apply_constraints(logits, [state(allowed_token_ids=[1]), state(logit_bias={2: 1.0}), state()])
    assert torch.equal(logits, before)


def test_constraints_cross_the_wire_and_are_checked() -> None:
    params = SamplingParams(logit_bias={5: 2.5}, allowed_token_ids=[1, 2], bad_words_token_ids=[[3, 4]],
                            prompt_logprobs=2)
    assert params_from_proto(params_to_proto(params)) == params
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="^allowed_token_ids names token ids past"):
        SamplingParams(allowed_token_ids=[3, 40]).check_vocab(VOCAB)
    with pytest.raises(ValueError, match="^bad_words names"):
        SamplingParams(bad_words_token_ids=[[3, 40]]).check_vocab(VOCAB)
