"""Penalties keep the engine overlapped (issue 32, point 5): a request with repetition,
presence or frequency penalties no longer turns async scheduling off for its batch. The
token still on the device when the next step launches is counted there
(ModelRunner._pending_tokens, sampler._penalties_with_pending), so the tokens are exactly
those of synchronous steps, which count it on the host."""

import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams

TOKENS = 40
PENALISED = [
    SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, presence_penalty=0.8),
    SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, frequency_penalty=0.6),
    SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=0.8,
                   presence_penalty=-0.5, frequency_penalty=0.4),  # fmt: skip
    SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=7, ignore_eos=True, frequency_penalty=0.9),
]
PLAIN = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(mesh_model_dir: str) -> tuple[LLM, LLM]:
    # Batch-invariant: the two engines' batches need not be cut alike for the tokens to agree.
    return (LLM(mesh_model_dir, async_scheduling=False, batch_invariant=True),
            LLM(mesh_model_dir, async_scheduling=True, batch_invariant=True))  # fmt: skip


def _prompts(n: int) -> list[list[int]]:
    # Short, repetitive prompts: the unpenalised model repeats itself, so penalties bite.
    return [[11 + (3 * i) % 7, 12, 13, 12, 13, 12] * 3 for i in range(n)]


def test_penalised_requests_decode_overlapped_and_exactly_as_synchronous(engines: tuple[LLM, LLM]) -> None:
    sync, overlapped = engines
    params = [PLAIN, *PENALISED, PLAIN]
    expected = [o.token_ids for o in sync.generate(_prompts(len(params)), params)]
    launched: list[int] = []
    executor = overlapped.engine.executor
    real = executor.launch

    def launch(sched):  # noqa: ANN001, ANN202 - counts the overlapped steps' penalised sampling rows
        requests = overlapped.engine.scheduler.requests
        launched.append(sum(1 for c in sched.chunks if c.sample and c.request_id in requests
                            and requests[c.request_id].sampling_params.needs_output_history))  # fmt: skip
        return real(sched)

    executor.launch = launch  # type: ignore[method-assign]
    try:
        got = [o.token_ids for o in overlapped.generate(_prompts(len(params)), params)]
    finally:
        del executor.launch
    assert got == expected
    # The penalised requests decoded on the overlapped path: every step of theirs launched.
    assert sum(launched) >= len(PENALISED) * (TOKENS - 1)
    # The penalties changed the tokens (the test could not pass with them ignored).
    unpenalised = [o.token_ids for o in sync.generate(_prompts(len(params)), [PLAIN] * len(params))]
    assert all(got[i] != unpenalised[i] for i in range(1, 1 + len(PENALISED)))

