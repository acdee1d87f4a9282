"""What a drafting step costs on the host (issue 13), with its outputs unchanged: the
verify step draws all its rows with one sampler call and one read-back, the draft
model's passes come back with one read-back, the fixed schedule (which reads no
confidence) neither fits temperatures nor asks the draft model for probabilities, and
the temperature fit that the scheduled modes run is the grid search by definition."""

import math
import random
from pathlib import Path

import pytest
import torch

from shared.engine.engine_request import EngineRequest
from shared.engine.llm import LLM
from shared.engine.sampler import Sampler, SamplingState
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.calibration import TEMPERATURE_GRID, SequentialTemperatureScaling, expected_calibration_error
from shared.engine.spec.draft_model import DraftModelDrafter, _common_prefix
from shared.engine.spec.verify import verify_batch, verify_request
from shared.model.loader import load_model

TRAINED = Path(__file__).resolve().parents[2] / "models" / "trained"


def _fit_by_definition(observations: list[tuple[list[float], int]], max_positions: int) -> list[float]:
    """STS as calibration.py's docstring states it: each trial survival recomputed whole."""

    def survival(raw: list[float], temps: list[float]) -> list[float]:
        out, a = [], 1.0
        for p, t in zip(raw, temps):
            p = min(max(p, 1e-6), 1 - 1e-6)
            x = math.log(p / (1 - p)) / t
            a *= 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))
            out.append(a)
        return out

    temps: list[float] = []
    for k in range(max_positions):
        rows = [(s, n) for s, n in observations if len(s) > k]
        if not rows:
            temps.append(1.0)
            continue
        observed = [n > k for _, n in rows]
        best_t, best_ece = 1.0, math.inf
        for t in TEMPERATURE_GRID:
            ece = expected_calibration_error([survival(s, [*temps, t])[k] for s, _ in rows], observed)
            if ece < best_ece - 1e-12:
                best_t, best_ece = t, ece
        temps.append(best_t)
    return temps


@pytest.mark.parametrize("seed", range(6))
def test_temperature_fit_is_the_grid_search_by_definition(seed: int) -> None:
    rng = random.Random(seed)
    max_positions = rng.randint(1, 5)
    sts = SequentialTemperatureScaling(max_positions, max_observations=300)
    observations = []
    for _ in range(rng.randint(1, 400)):
        raw = [rng.choice([rng.random(), 0.0, 1.0, 0.999]) for _ in range(rng.randint(1, max_positions))]
        accepted = rng.randint(0, len(raw))
        sts.observe(raw, accepted)
        observations.append((raw, accepted))
    assert sts.fit() == _fit_by_definition(observations[-300:], max_positions)


def test_verify_batch_draws_what_a_call_per_request_draws() -> None:
    vocab = 50
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(temperature=1.2, top_k=5, seed=11),
        SamplingParams(temperature=0.7, min_p=0.1, seed=3),
    ]
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        drafts = [[int(t) for t in torch.randint(0, vocab, (n,), generator=gen)] for n in (2, 1, 3, 2)]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=gen) * 3
        firsts = [10 + trial, 40 + trial, 5 + trial, 70]
        states = [SamplingState.create(p, [1, 2, 3]) for p in params]
        # A drafted token equal to the greedy draw passes: make the first request's pass.
        drafts[0] = logits[:2].argmax(-1).tolist()
        batched = verify_batch(logits, drafts, states, Sampler(seed=1), firsts)
        one_by_one, row = [], 0
        for draft, state, first in zip(drafts, states, firsts):
            one_by_one.append(verify_request(logits[row : row + len(draft) + 1], draft, state, Sampler(seed=1), first))
            row += len(draft) + 1
        assert batched == one_by_one
        assert batched[0].num_accepted == 2


def test_the_draft_model_without_scores_drafts_the_same_tokens() -> None:
    model = load_model(str(TRAINED / "draft"), dtype=torch.float32, device="cpu", kernels="torch")
    scored = DraftModelDrafter(model, 16, 64, torch.float32, torch.device("cpu"), cuda_graphs=False)
    plain = DraftModelDrafter(model, 16, 64, torch.float32, torch.device("cpu"), cuda_graphs=False, scores=False)
    contexts = {"a": [5, 9, 13, 9, 13, 21, 40], "b": [100, 200, 300, 7, 8]}
    proposals = {}
    for drafter in (scored, plain):
        first = drafter.propose(contexts, 4)
        moved = {"a": contexts["a"] + list(first["a"].tokens[:2]) + [77], "b": contexts["b"] + [3]}
        proposals[drafter] = (first, drafter.propose(moved, 3))
    for with_scores, without in zip(proposals[scored], proposals[plain]):
        for rid in ("a", "b"):
            assert without[rid].tokens == with_scores[rid].tokens
            assert without[rid].draft_probs is None and set(without[rid].confidences) == {1.0}
            assert with_scores[rid].draft_probs is not None
    assert not plain.has_scores and scored.has_scores


@pytest.mark.parametrize("batch", [1, 6])
def test_a_fixed_drafting_step_reads_back_twice_whatever_the_batch(batch: int, monkeypatch) -> None:  # noqa: ANN001
    """One read-back of the draft model's tokens (all passes), one of the verify step's
    draws (all requests); no temperature fit, no draft probabilities."""
    llm = LLM(str(TRAINED / "target"), speculative="draft", spec_draft_model=str(TRAINED / "draft"),
              spec_tokens=3, spec_schedule="fixed", max_num_seqs=batch)  # fmt: skip
    engine, speculator = llm.engine, llm.engine.speculator
    assert speculator is not None
    fits = []
    monkeypatch.setattr(speculator.temperature, "fit", lambda: fits.append(1))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineRequest(str(i), [5 + i, 9, 13, 9, 13, 21, 40], params))
    full_steps = 0
    while engine.has_unfinished_requests():
        reads.clear()
        before = speculator.stats.num_verifications
        engine.step()
        if speculator.stats.num_verifications - before == batch:  # every request verified
            full_steps += 1
            assert len(reads) == 2
    assert full_steps >= 5
    assert not fits and speculator.stats.num_verifications >= 32  # past REFIT_EVERY



def test_common_prefix_finds_the_first_difference_anywhere() -> None:
    base = list(range(100))
    for other, expected in [
        (base + [7, 8], 100),  # one extends the other
        (base[:60] + [-1] + base[61:], 60),  # far before the tail compared last
        (base[:95] + [-1] * 5, 95),  # within the tail
        ([-1] + base[1:], 0),
        ([], 0),
    ]:
        assert _common_prefix(base, other) == expected
        assert _common_prefix(other, base) == expected
