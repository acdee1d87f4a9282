"""Speculative decoding through the engine (issue 13): drafted tokens verified
losslessly (greedy output equals decoding without speculation; sampled output is
distributed as the target's), rejected slots rolled back in every KV group, with
chunked prefill, continuous batching, preemption and prefix caching; fallbacks
counted; the trained pair's draft model accepted on Python."""

from pathlib import Path

import pytest
import torch

import shared.engine.spec.speculator as speculator_module
from shared.engine.spec.schedule import SpsTable
from shared.engine.spec.speculator import StepCosts
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model
from tests.helpers.numerics import chi2_p_value_even_df

TRAINED = Path(__file__).resolve().parents[2] / "models" / "trained"
SMALL = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
"""Prompts span blocks, prefill is chunked, decode steps mix with prefill chunks."""


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("spec-target")))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """Same shapes and vocabulary, other weights: most drafts are rejected."""
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("spec-draft"), seed=5))


def _greedy(max_tokens: int = 28) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(model: str, prompts, params, **knobs):  # noqa: ANN001, ANN202
    llm = LLM(model, **knobs)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("schedule", ["fixed", "dspark", "capacity"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-self", "draft-other"])
def test_greedy_output_equals_decoding_without_speculation(target, other_draft, drafter, schedule, monkeypatch):
    # dspark with no warm-up: its own lengths (from the lookup prior / raw draft probabilities) from the first step.
    monkeypatch.setattr(speculator_module, "WARMUP_VERIFICATIONS", 0 if drafter == "ngram" else 8)
    prompts = random_prompts([5, 17, 33, 9, 21], vocab=500, seed=1)
    params = [_greedy(n) for n in (28, 7, 19, 28, 3)]  # max_tokens inside an accepted run too
    expected, _ = _run(target, prompts, params, **SMALL)
    knobs = dict(speculative="ngram" if drafter == "ngram" else "draft", spec_schedule=schedule, spec_tokens=3)
    if drafter != "ngram":
        knobs["spec_draft_model"] = target if drafter == "draft-self" else other_draft
    got, llm = _run(target, prompts, params, **SMALL, **knobs)
    assert got == expected
    load = llm.engine.load()
    assert load.num_spec_verifications > 0 and load.num_spec_drafted_tokens > 0
    assert load.num_spec_accepted_tokens <= load.num_spec_drafted_tokens
    assert sum(load.spec_accepted_by_position) == load.num_spec_accepted_tokens
    if drafter == "draft-self":  # a draft equal to the target is always right
        assert load.num_spec_accepted_tokens == load.num_spec_drafted_tokens
        assert load.mean_accepted_length > 2
    if drafter == "draft-other":
        assert load.num_spec_accepted_tokens < load.num_spec_drafted_tokens  # rollbacks happened
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks  # nothing leaked


def test_rejected_slots_are_rolled_back_in_every_kv_group(tmp_path, other_draft):
    # qwen2's tiny variant mixes full and sliding-window layers: two KV groups.
    hybrid = str(save_tiny_hf_model("qwen2", tmp_path / "hybrid"))
    draft = str(save_tiny_hf_model("qwen2", tmp_path / "hybrid-draft", seed=3))
    prompts = random_prompts([13, 30], vocab=500, seed=4)
    expected, _ = _run(hybrid, prompts, _greedy(24), block_size=4)
    llm = LLM(hybrid, block_size=4, speculative="draft", spec_draft_model=draft, spec_tokens=4)
    engine = llm.engine
    assert len(engine.kv.managers) >= 2
    for i, p in enumerate(prompts):
        from shared.engine.engine_request import EngineRequest

        engine.add_request(EngineRequest(str(i), p, _greedy(24)))
    rejected_seen = False
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = list(o.token_ids)
        stats = engine.speculator.stats
        rejected_seen |= stats.num_accepted_tokens < stats.num_drafted_tokens
        for request in engine.scheduler.running:
            # Every group holds blocks for the accepted length only (a sliding group's
            # dropped blocks are null entries, still counted in its table).
            for m in engine.kv.managers:
                assert len(m.table(request.request_id)) == -(-request.num_computed_tokens // 4)
            assert len(request.block_hashes) <= request.num_tokens // 4
    assert rejected_seen
    assert [out[str(i)] for i in range(len(prompts))] == expected
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_preemption_and_prefix_caching_with_speculation(target):
    prompts = random_prompts([30, 12, 25, 7, 19, 40], vocab=500, seed=2)
    params = _greedy(24)
    expected, _ = _run(target, prompts, params, block_size=4)
    tight = dict(block_size=4, num_kv_blocks=24, max_model_len=96, prefill_chunk_size=16)
    got, llm = _run(target, prompts, params, **tight, speculative="draft", spec_draft_model=target)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert llm.engine.kv.pool.num_free_blocks == 24

    # A second request sharing a long prefix hits the blocks the first one left, drafted tokens never among them.
    prefix = random_prompts([48], vocab=500, seed=3)[0]
    warm = LLM(target, block_size=8, speculative="ngram")
    first = warm.generate([prefix + [11, 12]], params)[0]
    second = warm.generate([prefix + [21, 22]], params)[0]
    cold, _ = _run(target, [prefix + [21, 22]], params, block_size=8, enable_prefix_caching=False)
    assert second.token_ids == cold[0]
    assert second.num_cached_tokens == 48
    again = warm.generate([prefix + [11, 12] + first.token_ids[:-1]], _greedy(4))[0]
    assert again.num_cached_tokens > 48  # the accepted output's blocks were indexed


def test_fallbacks_are_counted_and_decode_normally(target):
    prompts = random_prompts([9, 14], vocab=500, seed=6)
    plain = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=12),
             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)]  # fmt: skip
    expected, base = _run(target, prompts, plain)
    got, llm = _run(target, prompts, plain, speculative="draft", spec_draft_model=target, async_scheduling=False)
    assert got == expected
    load = llm.engine.load()
    # The min_tokens request falls back; the logprobs one drafts (test_logprobs_with_speculation).
    assert load.spec_fallbacks["min_tokens"] > 0 and "logprobs" not in load.spec_fallbacks
    assert 0 < load.num_spec_verifications < sum(len(t) for t in got)
    # Overlapped: a bad-words request reads the host's history, so no step drafts (each is
    # counted), and none gives overlap up for drafting (its steps stay overlapped); a
    # penalties request drafts (test_penalties_with_speculation).
    words = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words_token_ids=[[1, 2]])
    alone, _ = _run(target, prompts[:1], words)
    got, llm = _run(target, prompts[:1], words, speculative="draft", spec_draft_model=target, async_scheduling=True)
    assert got == alone
    load = llm.engine.load()
    assert load.num_spec_verifications == 0 and load.spec_fallbacks["bad_words"] > 0
    assert "async_scheduling" not in load.spec_fallbacks  # no step drafted: none gave overlap up
    penalised = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    alone, _ = _run(target, prompts[:1], penalised)
    got, llm = _run(target, prompts[:1], penalised, speculative="draft", spec_draft_model=target,
                    async_scheduling=True)  # fmt: skip
    assert got == alone and llm.engine.load().num_spec_verifications > 0
    # prompt_logprobs: scored before the first token, then the request drafts.
    scored = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    a = LLM(target).generate(prompts[:1], scored)[0]
    spec = LLM(target, speculative="draft", spec_draft_model=target, async_scheduling=True)
    b = spec.generate(prompts[:1], scored)[0]
    assert b.token_ids == a.token_ids and spec.engine.load().num_spec_verifications > 0
    assert spec.engine.load().spec_fallbacks["async_scheduling"] > 0  # asked for, given up for drafting


@pytest.mark.parametrize("drafter", ["ngram", "draft-self", "draft-other"])
def test_logprobs_with_speculation(target, other_draft, drafter):
    # Issue 32: a request with logprobs drafts, and each emitted token (accepted, bonus or
    # correction) gets the logprob, rank and top-k the target gives it without speculation.
    prompts = random_prompts([5, 17, 33, 9, 21], vocab=500, seed=7)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=k)
              for n, k in ((28, 5), (7, 5), (19, 0), (28, 5), (3, 5))]  # fmt: skip
    llm = LLM(target, **SMALL)
    expected = llm.generate(prompts, params)
    knobs = dict(speculative="ngram", spec_tokens=3) if drafter == "ngram" else dict(
        speculative="draft", spec_tokens=3, spec_draft_model=target if drafter == "draft-self" else other_draft)
    spec = LLM(target, **SMALL, **knobs)  # fmt: skip
    got = spec.generate(prompts, params)
    load = spec.engine.load()
    assert "logprobs" not in load.spec_fallbacks and not load.spec_fallbacks
    # Every request asks for logprobs, so these drafted and accepted tokens are theirs
    # (the other model's drafts all fail here: every emitted token is a correction or bonus).
    assert load.num_spec_drafted_tokens > 0 and (load.num_spec_accepted_tokens > 0 or drafter == "draft-other")
    for a, b, p in zip(expected, got, params):
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.token_id == x.token_id and y.rank == x.rank
            assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
            assert len(y.top) == len(x.top) == p.logprobs
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-5)


@pytest.mark.parametrize("drafter", ["ngram", "draft-self", "draft-other"])
def test_penalties_with_speculation(target, other_draft, drafter):
    # Issue 32: a request with penalties drafts; each verify row is penalised with the
    # drafted tokens before it counted, so its tokens are those of plain decoding.
    prompts = random_prompts([5, 17, 33, 9, 21, 12], vocab=500, seed=8)
    params = [
        SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, presence_penalty=0.1),
        SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True, frequency_penalty=0.05, logprobs=3),
        SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, repetition_penalty=0.9,
                       presence_penalty=-0.05, frequency_penalty=0.03),
        SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True, frequency_penalty=0.1),
        SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True, repetition_penalty=1.02),
    ]  # fmt: skip
    llm = LLM(target, **SMALL, seed=4)
    expected = llm.generate(prompts, params)
    knobs = dict(speculative="ngram", spec_tokens=3) if drafter == "ngram" else dict(
        speculative="draft", spec_tokens=3, spec_draft_model=target if drafter == "draft-self" else other_draft)
    spec = LLM(target, **SMALL, seed=4, **knobs)  # fmt: skip
    got = spec.generate(prompts, params)
    load = spec.engine.load()
    assert not load.spec_fallbacks
    assert load.num_spec_drafted_tokens > 0 and (load.num_spec_accepted_tokens > 0 or drafter == "draft-other")
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]  # seeded and unseeded sampling too
    for x, y in zip(expected[2].logprobs, got[2].logprobs, strict=True):  # raw logprobs, as without drafts
        assert y.token_id == x.token_id and y.logprob == pytest.approx(x.logprob, abs=1e-5)


def test_sampled_speculation_emits_the_targets_distribution(tmp_path):
    import transformers

    vocab, n = 5, 1500
    path = save_tiny_hf_model("llama", tmp_path / "v5", vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    prompt = [1, 3, 1, 3, 1, 3, 1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def next_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].softmax(-1)

    p1 = next_probs(prompt)
    p2 = torch.stack([next_probs(prompt + [a]) for a in range(vocab)])  # [t1, t2]
    expected_t2 = (p1.unsqueeze(1) * p2).sum(0)
    draft = save_tiny_hf_model("llama", tmp_path / "v5-draft", seed=9, vocab_size=vocab, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0)  # fmt: skip
    llm = LLM(str(path), speculative="draft", spec_draft_model=str(draft), spec_tokens=2, max_num_seqs=256)
    params = [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    counts = torch.zeros(vocab)
    for o in outs:
        counts[o.token_ids[1]] += 1
    load = llm.engine.load()
    assert load.num_spec_verifications >= n  # every second token came out of verification
    assert 0 < load.num_spec_accepted_tokens < load.num_spec_drafted_tokens
    stat = float(((counts - n * expected_t2) ** 2 / (n * expected_t2)).sum())
    assert chi2_p_value_even_df(stat, vocab - 1) > 1e-4


@pytest.mark.skipif(not (TRAINED / "draft" / "model.safetensors").is_file(), reason="the trained pair is not here")
def test_trained_pair_draft_model_accepts_on_python_and_stops_at_a_stop_string():
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    params = SamplingParams(max_tokens=40, temperature=0.0)
    target = str(TRAINED / "target")
    plain = LLM(target).generate([prompt], params)[0]
    spec = LLM(target, speculative="draft", spec_draft_model=str(TRAINED / "draft"), spec_schedule="dspark")
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids and out.text == plain.text
    assert spec.engine.load().mean_accepted_length > 1.0
    # A stop string completed inside an accepted run ends the request at that token.
    stop_at = plain.text[len(plain.text) // 3 : len(plain.text) // 3 + 3]
    stopped = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_at])
    a = LLM(target).generate([prompt], stopped)[0]
    b = LLM(target, speculative="ngram", spec_tokens=6).generate([prompt], stopped)[0]
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, "stop")


PINNED_STEP_S = 0.01
"""A step's cost as test_a_drafter_that_costs_more_than_it_yields_drafts_only_its_probes tells
the schedule: any step, plain or verifying (a flat profile, no overhead)."""


@pytest.mark.parametrize("schedule", ["dspark", "capacity"])
def test_a_drafter_that_costs_more_than_it_yields_drafts_only_its_probes(target, schedule, monkeypatch):
    """The scheduled modes choose the drafting depth from measured costs: with drafting
    dearer than a step (here told so), they decode as without speculation, drafting only
    in probes to keep measuring: at most one in PROBE_EVERY steps, and only once the plain
    steps since the last took 1 / PROBE_BUDGET times what it cost (a budget of 1e9: the
    steps decide; of 1e-9: no second probe in this run). With drafting free they draft
    every step."""
    monkeypatch.setattr(speculator_module, "WARMUP_VERIFICATIONS", 0)
    monkeypatch.setattr(speculator_module, "PROBE_EVERY", 6)
    prompts = random_prompts([6, 11], vocab=50, seed=3)  # a small vocabulary repeats: lookup drafts
    params = _greedy(40)
    expected, _ = _run(target, prompts, params)
    verifications, overlap_given_up = {}, {}
    for label, pass_seconds, budget in (("dear", 1.0, 1e9), ("dear, budgeted", 1.0, 1e-9), ("free", 0.0, 1e9)):
        monkeypatch.setattr(speculator_module, "PROBE_BUDGET", budget)
        # Overlapped steps asked for: a step that drafts must give them up, one that does not keeps them.
        llm = LLM(target, speculative="ngram", spec_tokens=3, spec_schedule=schedule, async_scheduling=True)
        costs = llm.engine.speculator.costs
        costs.draft_pass_s = {1: pass_seconds, 2: pass_seconds}
        costs.observe_drafting = lambda *args: None  # keep the cost as told...
        costs.observe_realized = lambda *args: None  # ... and the model's prior for every depth
        # ... and the step costs too: a flat profile and plain steps of PINNED_STEP_S. Measured on
        # a loaded machine, they made free drafting look dear (8 verifications against 8).
        llm.engine.speculator.sps = SpsTable((1,), (1 / PINNED_STEP_S,))
        costs.observe_plain_step = lambda n, _seconds, c=costs: StepCosts.observe_plain_step(c, n, PINNED_STEP_S)
        costs.observe_overhead = lambda *args: None
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert got == expected
        verifications[label] = llm.engine.load().num_spec_verifications
        overlap_given_up[label] = llm.engine.load().spec_fallbacks.get("async_scheduling", 0)
    steps = 40
    assert 0 < verifications["dear"] <= 2 * (steps // 6 + 1)  # the probes only
    # Free drafting verifies more often than the probes alone (20-21 against 8 with the step
    # costs pinned; measured, a loaded machine once made it 8 against 8).
    assert verifications["free"] > verifications["dear"]
    # Only the probes left the fast path: one in every 7 steps (6 plain, then the probe)...
    assert 4 <= overlap_given_up["dear"] <= steps // 7, overlap_given_up
    # ... or, on a budget its plain steps never earn back, the first probe only.
    assert overlap_given_up["dear, budgeted"] == 1, overlap_given_up
    assert 0 < verifications["dear, budgeted"] <= 2
    assert overlap_given_up["free"] > overlap_given_up["dear"]


def test_settings_are_checked():
    for bad in (dict(speculative="eagle"), dict(spec_schedule="best"), dict(spec_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
