"""Masks made on the host keep the engine overlapped (issue 32, point 5): a structured
output, min_tokens or bad words no longer turns async scheduling off for its batch. A
step with such a row launches its forward before the step before is read back, and
samples once it is (ModelRunner.launch, then .sample: the grammar's matcher has accepted
the token, the output's length and last tokens are known), with the mask applied on the
device. The tokens are exactly those of synchronous steps, greedy and seeded; the steps
are counted in EngineLoad.steps."""

import json
import re

import jsonschema
import pytest

from shared.engine.llm import LLM
from shared.engine.outputs import StepCounts
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured.spec import StructuredSpec

from tests.helpers.structured_schemas import MAX_TOKENS, random_prompt, random_schema

TOKENS = 24
NUM_SCHEMAS = 3
REGEX = r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)"


@pytest.fixture(scope="module")
def engines(mesh_model_dir: str) -> tuple[LLM, LLM]:
    # Batch-invariant: the two engines' batches need not be cut alike for the tokens to agree.
    return (LLM(mesh_model_dir, async_scheduling=False, batch_invariant=True),
            LLM(mesh_model_dir, async_scheduling=True, batch_invariant=True))  # fmt: skip


def _plain(seed: int | None = None) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=seed, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, StepCounts]:
    """The outputs and the steps they took, by how they ran."""
    before = llm.engine.load().steps
    outs = llm.generate(prompts, params)
    after = llm.engine.load().steps
    return outs, StepCounts(after.overlapped - before.overlapped,
                            after.sampled_after_read_back - before.sampled_after_read_back,
                            after.synchronous - before.synchronous)  # fmt: skip


def _assert_overlapped(steps: StepCounts, masked_tokens: int) -> None:
    """Every step ran overlapped (today's fallback ran the whole batch synchronously),
    and each token of the masked requests was sampled after the read-back."""
    assert steps.synchronous == 0, steps
    assert steps.overlapped > 0, steps
    assert steps.sampled_after_read_back >= masked_tokens, steps


def test_structured_requests_decode_overlapped_and_exactly_as_synchronous(engines: tuple[LLM, LLM]) -> None:
    sync, overlapped = engines
    schemas = [random_schema(i) for i in range(NUM_SCHEMAS)]
    structured = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                       structured=StructuredSpec("json", json.dumps(schemas[0]))),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                       structured=StructuredSpec("json", json.dumps(schemas[1]))),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=5,
                       structured=StructuredSpec("json", json.dumps(schemas[2]))),
        SamplingParams(max_tokens=40, temperature=1.0, seed=9, structured=StructuredSpec("regex", REGEX)),
        SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredSpec("regex", REGEX)),
    ]  # fmt: skip
    params = [_plain(), *structured, _plain(seed=11), _plain()]
    prompts = [random_prompt(i) for i in range(len(params))]
    expected, sync_steps = _run(sync, prompts, params)
    got, steps = _run(overlapped, prompts, params)
    assert sync_steps.overlapped == 0 and sync_steps.synchronous > 0  # the counters tell the two apart
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for i, schema in enumerate(schemas):
        assert got[1 + i].finish_reason == "stop", got[1 + i].text
        jsonschema.validate(json.loads(got[1 + i].text), schema)
    for out in got[4:6]:
        assert re.fullmatch(REGEX, out.text), out.text
    # The plain requests were not cut short: they decoded in the same steps throughout.
    assert all(len(got[i].token_ids) == TOKENS for i in (0, 6, 7))
    _assert_overlapped(steps, max(len(o.token_ids) for o in got[1:6]) - 1)


def _reference(sync: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The plain batch's greedy and seeded outputs: where the masks must bite."""
    return [o.token_ids for o in sync.generate(prompts, [_plain(), _plain(seed=4)])]


def test_min_tokens_decode_overlapped_and_exactly_as_synchronous(engines: tuple[LLM, LLM]) -> None:
    sync, overlapped = engines
    prompts = [random_prompt(i) for i in range(2, 6)]
    free = _reference(sync, prompts[:2])
    # A stop token the free output reaches at its third token: min_tokens holds it back.
    held = [SamplingParams(max_tokens=TOKENS, temperature=0.0, min_tokens=12, stop_token_ids=[free[0][2]]),
            SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=4, min_tokens=12,
                           stop_token_ids=[free[1][2]], repetition_penalty=1.2)]  # fmt: skip
    params = [*held, _plain(), _plain(seed=8)]
    expected, _ = _run(sync, prompts, params)
    got, steps = _run(overlapped, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for out in got[:2]:
        assert len(out.token_ids) >= 12  # without min_tokens the first would stop at 3 tokens
    _assert_overlapped(steps, 12 - 1)


def test_bad_words_decode_overlapped_and_exactly_as_synchronous(engines: tuple[LLM, LLM]) -> None:
    sync, overlapped = engines
    prompts = [random_prompt(i) for i in range(6, 10)]
    free = _reference(sync, prompts[:2])
    # Words the free outputs hold: one token, and two (banned only after its first token).
    words = [[[free[0][3]], free[0][5:7]], [[free[1][2]], free[1][4:6]]]
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, bad_words_token_ids=words[0]),
              SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=4, ignore_eos=True,
                             bad_words_token_ids=words[1]),
              _plain(), _plain(seed=8)]  # fmt: skip
    expected, _ = _run(sync, prompts, params)
    got, steps = _run(overlapped, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for out, banned, before in zip(got[:2], words, free):
        assert out.token_ids != before
        assert banned[0][0] not in out.token_ids
        pairs = list(zip(out.token_ids, out.token_ids[1:]))
        assert tuple(banned[1]) not in pairs
    _assert_overlapped(steps, TOKENS - 1)
