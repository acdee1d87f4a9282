"""Speculative decoding's model-free parts: the prompt-lookup drafter, calibration
of confidences, DSpark's verification schedule and lossless verification (the
rejection sampler's output must be distributed as the target: a chi-square test
that a broken verifier fails)."""

import math
import random

import pytest
import torch

from shared.engine.spec.calibration import (
    AcceptanceByPosition,
    SequentialTemperatureScaling,
    expected_calibration_error,
)
from shared.engine.spec.drafter import Draft, PromptLookupDrafter
from shared.engine.spec.rejection import verify_greedy, verify_sampled
from shared.engine.spec.schedule import (
    SpsTable,
    capacity,
    choose_depth,
    expected_throughput,
    schedule_greedy,
    schedule_with_capacity,
)
from tests.helpers.numerics import chi2_p_value_even_df

# -- drafting ---------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_most_recent_match():
    drafter = PromptLookupDrafter(max_ngram=3)
    #          0  1  2  3  4  5  6  7  8  9 10
    context = [5, 6, 7, 8, 9, 1, 6, 7, 3, 6, 7]
    # The tail (6, 7) occurs at 1 and 6; the trigram (3, 6, 7) nowhere before: the
    # bigram's most recent match (at 6) is followed by 3, 6, 7.
    assert drafter.propose(context, 3).tokens == (3, 6, 7)
    assert drafter.propose(context, 1).tokens == (3,)
    assert drafter.propose([1, 2, 3, 4], 4).tokens == ()  # nothing repeats
    draft = PromptLookupDrafter(position_confidence=[0.9, 0.5]).propose(context, 3)
    assert draft.confidences == (0.9, 0.5, 0.5) and draft.survival() == pytest.approx([0.9, 0.45, 0.225])


def test_a_draft_refuses_confidences_outside_0_1_or_of_another_length():
    with pytest.raises(ValueError, match="confidences"):
        Draft((1, 2), (0.5,))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Draft((1,), (1.5,))


# -- calibration ------------------------------------------------------------------------


def test_acceptance_by_position_counts_only_positions_reached():
    acc = AcceptanceByPosition(max_positions=3, prior_weight=0.0)
    acc.observe(3, 1)  # position 1 passed, 2 failed, 3 never judged
    acc.observe(3, 3)
    acc.observe(2, 0)
    assert acc.rates()[:2] == pytest.approx([2 / 3, 1 / 2])
    assert acc.rates()[2] == pytest.approx(1.0)  # reached once (the all-accepted draft), passed


def test_sequential_temperature_scaling_calibrates_an_overconfident_drafter():
    rng = random.Random(0)
    sts = SequentialTemperatureScaling(max_positions=2)
    raw_rows = []
    for _ in range(3000):
        raw = [rng.uniform(0.6, 0.99), rng.uniform(0.6, 0.99)]
        # The truth: a position passes with a much lower chance than the drafter claims.
        truth = [1 / (1 + math.exp(-math.log(p / (1 - p)) / 3)) for p in raw]
        truth = [0.5 + (t - 0.5) * 0.6 for t in truth]
        accepted = 0
        while accepted < 2 and rng.random() < truth[accepted]:
            accepted += 1
        sts.observe(raw, accepted)
        raw_rows.append((raw, accepted))
    temps = sts.fit()
    assert temps[0] > 1.5  # flattening an overconfident score
    for k in range(2):
        rows = [(r, n) for r, n in raw_rows]
        predicted_raw = [math.prod(r[: k + 1]) for r, _ in rows]
        predicted_cal = [math.prod(sts.confidences(r)[: k + 1]) for r, _ in rows]
        observed = [n > k for _, n in rows]
        assert expected_calibration_error(predicted_cal, observed) < 0.5 * expected_calibration_error(
            predicted_raw, observed
        )


# -- the verification schedule ----------------------------------------------------------


def test_sps_table_interpolates_and_holds_flat():
    sps = SpsTable((1, 16, 64), (100.0, 80.0, 40.0))
    assert sps(1) == 100.0 and sps(8) == pytest.approx(100 - 20 * 7 / 15) and sps(200) == 40.0
    with pytest.raises(ValueError, match="increase"):
        SpsTable((4, 2), (1.0, 1.0))


def test_greedy_admits_while_theta_improves_and_stops_at_the_first_non_improvement():
    # Free verification: every drafted token with any survival pays.
    flat = SpsTable((1,), (50.0,))
    assert schedule_greedy([[0.9, 0.5], [0.2]], flat) == [2, 1]
    # A step costs 10 % more per token: a token pays only while a > ~10 % of tau.
    steep = SpsTable((1, 2, 3, 4, 5), (100.0, 100 / 1.1, 100 / 1.21, 100 / 1.331, 100 / 1.4641))
    lengths = schedule_greedy([[0.9, 0.8, 0.05]], steep)
    assert lengths == [2]
    assert expected_throughput([2], [[0.9, 0.8, 0.05]], steep) > expected_throughput([3], [[0.9, 0.8, 0.05]], steep)
    assert expected_throughput([2], [[0.9, 0.8, 0.05]], steep) > expected_throughput([1], [[0.9, 0.8, 0.05]], steep)
    # Stop at the first non-improvement even if a later admission would have paid again:
    # with SPS falling off a cliff at 3 tokens and recovering, the schedule stops at 2.
    cliff = SpsTable((2, 3, 4), (100.0, 10.0, 100.0))
    assert schedule_greedy([[0.9, 0.9], [0.8]], cliff) == [0, 0]  # B = 2 (R), the first candidate makes 3


def test_greedy_never_verifies_a_position_before_the_one_ahead_of_it():
    rng = random.Random(1)
    sps = SpsTable((1, 8, 32, 128), (100.0, 95.0, 70.0, 20.0))
    for _ in range(200):
        rows = []
        for _ in range(rng.randint(1, 6)):
            a, row = 1.0, []
            for _ in range(rng.randint(0, 5)):
                a *= rng.uniform(0.3, 1.0)
                row.append(a)
            rows.append(row)
        lengths = schedule_greedy(rows, sps)
        assert all(0 <= n <= len(row) for n, row in zip(lengths, rows))
        # The admitted set is the top of the pool: nothing left out beats something taken.
        taken = [row[j] for n, row in zip(lengths, rows) for j in range(n)]
        left = [row[j] for n, row in zip(lengths, rows) for j in range(n, len(row))]
        assert not taken or not left or min(taken) >= max(left)


def test_survivals_that_increase_are_refused():
    with pytest.raises(ValueError, match="not increase"):
        schedule_greedy([[0.5, 0.6]], SpsTable((1,), (1.0,)))


def test_capacity_from_old_survivals_then_the_best_current_candidates():
    sps = SpsTable((1, 2, 3, 4, 5, 6, 7, 8), (100.0, 99, 98, 97, 96, 95, 50, 49))
    old = [[0.9, 0.8], [0.7, 0.1]]
    assert schedule_greedy(old, sps) == [2, 2] and capacity(old, sps) == 4
    # This step's confidences differ: K is kept, and the K best current tokens are
    # taken, each request's as a prefix.
    assert schedule_with_capacity([[0.2, 0.1], [0.95, 0.9]], 3) == [1, 2]
    # A CUDA-graph bucket: the greedy alone stops at one drafted token (B = 2), but a
    # step padded to the bucket of 5 costs little more, so filling it pays...
    one = [[0.9, 0.5, 0.3, 0.2]]
    cheap_bucket = SpsTable((1, 2, 3, 4, 5), (100.0, 90.0, 60.0, 59.0, 60.0))
    assert schedule_greedy(one, cheap_bucket) == [1]
    assert capacity(one, cheap_bucket, buckets=[5]) == 4
    # ... and when the padded step is slow it does not.
    dear_bucket = SpsTable((1, 2, 3, 4, 5), (100.0, 90.0, 60.0, 59.0, 50.0))
    assert capacity(one, dear_bucket, buckets=[5]) == 1
    assert capacity(one, cheap_bucket, buckets=[2]) == 1  # the bucket the greedy already fills


def test_the_sps_profile_never_has_a_larger_step_run_faster():
    from shared.engine.spec.setup import sps_profile

    # Launch-bound timings, nearly flat and noisy (as eager steps of an 8B model on the
    # H200: 26, 19, 20, 16 ms...): the profile holds the slowest rate seen so far.
    seconds = {1: 0.026, 2: 0.019, 4: 0.020, 8: 0.016, 16: 0.017, 32: 0.030, 40: 0.029}
    sps = sps_profile(seconds.__getitem__, 40)
    assert sps.tokens == (1, 2, 4, 8, 16, 32, 40)
    expected = [1 / 0.026] * 5 + [1 / 0.030] * 2
    assert sps.steps_per_s == pytest.approx(expected)


def test_a_step_cost_besides_the_forward_makes_verifying_more_worth_it():
    # SPS drops from 100 to 60 steps/s when B goes 1 -> 2: verifying a token of survival
    # 0.5 gives 1.5 tokens per 1/60 s = 90 tok/s < 100. With 10 ms the step costs anyway
    # (drafting done, bookkeeping), it gives 1.5 / (10 + 16.7 ms) = 56 > 1 / 20 ms = 50.
    sps = SpsTable((1, 2), (100.0, 60.0))
    assert schedule_greedy([[0.5]], sps) == [0]
    assert schedule_greedy([[0.5]], sps, fixed_seconds=0.010) == [1]


def test_depth_counts_the_drafting_passes_and_drafts_nothing_when_drafts_do_not_pay():
    flat = SpsTable((1, 64), (100.0, 100.0))  # verifying costs nothing extra
    survival = [0.8, 0.64, 0.51, 0.41]
    assert choose_depth(4, survival, flat, draft_seconds=0.0) == 4  # free drafts: all of them
    # A pass costs a whole step: depth d gives (1 + Σ ā) tokens per (d + 1) steps, always < 1.
    assert choose_depth(4, survival, flat, draft_seconds=0.010) == 0
    # A pass costs 2 ms, a step 10 ms: tokens per ms and request are d=0 1/10, d=1 1.8/12,
    # d=2 2.44/14, d=3 2.95/16 = 0.184, d=4 3.36/18 = 0.187: the deepest pays most.
    assert choose_depth(4, survival, flat, draft_seconds=0.002) == 4
    # 4 ms: d=1 1.8/14 = .129, d=2 2.44/18 = .136, d=3 2.95/22 = .134: depth 2.
    assert choose_depth(4, survival, flat, draft_seconds=0.004) == 2
    # The step's own overhead is paid whatever the depth, so it favours drafting deeper.
    assert choose_depth(4, survival, flat, draft_seconds=0.004, overhead_seconds=0.010) == 4
    # What steps of a depth really gave, once measured, overrides the model's estimate.
    # (the model alone: d=2 at 697 tokens/s, plain 400)
    assert choose_depth(4, survival, flat, draft_seconds=0.002, measured={4: 100.0, 3: 350.0, 2: 300.0, 1: 800.0}) == 1
    assert choose_depth(4, survival, flat, draft_seconds=0.0, plain_seconds=0.010, measured={d: 300.0 for d in (1, 2, 3, 4)}) == 0
    # A verify step that grows dear with B stops depth early even when drafting is free.
    steep = SpsTable((4, 8, 12, 16, 20), (100.0, 50.0, 30.0, 20.0, 10.0))
    assert choose_depth(4, survival, steep, draft_seconds=0.0) == 0


# -- lossless verification --------------------------------------------------------------


def test_greedy_verification_emits_the_targets_argmax_sequence():
    vocab = 6
    best = [3, 1, 4, 2]
    logits = torch.full((4, vocab), -1.0)
    logits[torch.arange(4), torch.tensor(best)] = 5.0
    assert verify_greedy([3, 1, 4], logits).tokens == [3, 1, 4, 2]  # all pass, bonus
    out = verify_greedy([3, 5, 4], logits)
    assert out.num_accepted == 1 and out.tokens == [3, 1]  # the second is corrected


def _first_token_counts(verifier, p, q, n, seed) -> torch.Tensor:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    drafts = torch.multinomial(q[0], n, replacement=True, generator=gen).tolist()
    uniforms = torch.rand(n, generator=gen)
    for x, u in zip(drafts, uniforms):
        counts[verifier([x], q, p, u.view(1), gen).tokens[0]] += 1
    return counts


def test_rejection_sampling_emits_the_targets_distribution_and_a_broken_verifier_does_not():
    gen = torch.Generator().manual_seed(7)
    vocab, n = 5, 20000
    p = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(1, vocab, generator=gen) * 1.5, dim=-1)

    def chi2(counts: torch.Tensor) -> float:
        expected = p[0] * n
        return chi2_p_value_even_df(float(((counts - expected) ** 2 / expected).sum()), vocab - 1)

    assert chi2(_first_token_counts(verify_sampled, p, q, n, seed=1)) > 1e-4

    def accept_always(tokens, q_, p_, u, g):  # noqa: ANN001, ANN202
        return verify_sampled(tokens, q_, p_, torch.zeros_like(u) - 1.0, g)  # u < 0: every test passes

    assert chi2(_first_token_counts(accept_always, p, q, n, seed=1)) < 1e-6  # emits q, not p


def test_a_draft_equal_to_the_target_is_always_accepted_and_the_bonus_follows_the_target():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, 4, generator=gen), dim=-1)
    out = verify_sampled([2, 1], p[:2].clone(), p, torch.rand(2, generator=gen) * 0.999, gen)
    assert out.num_accepted == 2 and out.tokens[:2] == [2, 1] and len(out.tokens) == 3


def test_a_stall_in_one_plain_step_does_not_make_drafting_look_cheap():
    """StepCosts' plain-step estimate takes a step at most PLAIN_STEP_CLIP times the
    estimate: one 50 ms stall among 2 ms steps moves it by a tenth of 1 ms, not by 5 ms
    (which made choose_depth try a depth that needs the draft model's catch-up)."""
    from shared.engine.spec.speculator import EMA, PLAIN_STEP_CLIP, StepCosts

    costs = StepCosts()
    for _ in range(20):
        costs.observe_plain_step(64, 0.002)
    costs.observe_plain_step(64, 0.050)
    assert costs.plain_step(64) == pytest.approx(0.002 + EMA * (PLAIN_STEP_CLIP - 1) * 0.002)
    for _ in range(40):  # a lasting change still comes through, a step at a time
        costs.observe_plain_step(64, 0.004)
    assert costs.plain_step(64) == pytest.approx(0.004, rel=0.05)


def test_the_capacity_schedule_takes_k_from_survivals_two_steps_old_rounded_to_a_graph_bucket():
    from shared.engine.spec.schedule import CapacitySchedule

    sps = SpsTable((1, 2, 3, 4, 5, 6, 7, 8), (100.0, 99, 98, 97, 96, 95, 50, 49))
    rich, poor = [[0.9, 0.8], [0.7, 0.1]], [[0.0, 0.0], [0.0, 0.0]]
    assert capacity(rich, sps) == 4 and capacity(poor, sps) == 0
    plan = CapacitySchedule(sps)
    # No old survivals for the first two steps: DSpark's greedy on the current ones.
    assert plan.lengths(rich) == schedule_greedy(rich, sps) == [2, 2]
    assert plan.lengths(poor) == schedule_greedy(poor, sps) == [0, 0]
    # Step 3: K = 4 from step 1 (rich), not 0 from step 2 (poor) one step old.
    assert plan.lengths(poor) == [2, 2]
    # Step 4: K = 0 from step 2 (poor), although this step's survivals are rich.
    assert plan.lengths(rich) == [0, 0]
    # Graph buckets: the greedy stops at one token (B = 2); a step padded to 5 rows costs
    # little more, so K fills the bucket (capacity's rounding, which the engine passes).
    one, cheap_bucket = [[0.9, 0.5, 0.3, 0.2]], SpsTable((1, 2, 3, 4, 5), (100.0, 90.0, 60.0, 59.0, 60.0))
    graphed, eager = CapacitySchedule(cheap_bucket, buckets=(1, 5)), CapacitySchedule(cheap_bucket)
    for _ in range(2):
        graphed.lengths(one), eager.lengths(one)
    assert graphed.lengths(one) == [4] and eager.lengths(one) == [1]



@pytest.mark.parametrize(
    "penalty", [dict(frequency_penalty=0.3), dict(presence_penalty=0.3), dict(repetition_penalty=1.5)]
)
def test_verify_rows_are_penalised_with_the_drafted_tokens_before_them(penalty):
    # Issue 32: every row prefers token 2, by less than the penalty once a 2 is in the
    # output. Plain decoding emits 2 then 3; so must verification of the draft [2, 2]
    # (the second 2 is rejected: row 1 counts the first as output).
    from shared.engine.sampler import Sampler, SamplingState
    from shared.engine.sampling_params import SamplingParams
    from shared.engine.spec.verify import verify_batch

    logits = torch.tensor([[0.0, 0.0, 1.0, 0.9]] * 3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **penalty)
    state = SamplingState.create(params, [0, 1])
    (verified,) = verify_batch(logits, [[2, 2]], [state], Sampler(), [2])
    assert (verified.num_accepted, verified.tokens) == (1, [2, 3])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_with_penalties_draws_what_plain_decoding_draws(temperature):
    # Random rows and drafts (half of them the plain draws, so runs get accepted): the
    # verified tokens are those of sampling one row at a time, the output growing.
    from shared.engine.sampler import Sampler, SamplingState
    from shared.engine.sampling_params import SamplingParams
    from shared.engine.spec.verify import verify_batch

    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=5, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.4)  # fmt: skip
    accepted = 0
    for trial in range(40):
        logits = torch.randn(5, 6, generator=gen)
        prompt = torch.randint(0, 6, (3,), generator=gen).tolist()
        plain = SamplingState.create(params, prompt)
        plain.output_token_ids += [1, 4]
        sampler = Sampler()
        draws = []
        for i in range(5):
            token = sampler(logits[i : i + 1], [plain], [5 + i]).token_ids[0]
            plain.output_token_ids.append(token)
            draws.append(token)
        noise = torch.randint(0, 6, (4,), generator=gen).tolist()
        draft = [d if trial % 2 == 0 or k < trial % 4 else n for k, (d, n) in enumerate(zip(draws, noise))]
        state = SamplingState.create(params, prompt)
        state.output_token_ids += [1, 4]
        (verified,) = verify_batch(logits, [draft], [state], Sampler(), [5])
        expected_accepted = next((k for k in range(4) if draft[k] != draws[k]), 4)
        assert (verified.num_accepted, verified.tokens) == (expected_accepted, draws[: expected_accepted + 1])
        assert state.output_token_ids == [1, 4]  # the rows' views left the request's output alone
        accepted += verified.num_accepted
    assert accepted > 40
