"""Driving one engine request to its end, for the tests that check what it returns."""

from typing import Any

from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.engine.sampling_params import SamplingParams


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, **request: Any) -> RequestOutput:
    """Add the request (EngineRequest fields in `request`), step the engine until nothing
    is left, and return the request's last output."""
    engine.add_request(EngineRequest(rid, prompt, params, **request))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    assert final is not None, f"{rid} never finished"
    return final


def generate(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, **request: Any) -> tuple[
    RequestOutput, list[TokenLogprobs]
]:
    """As run, and the logprobs of every token the request produced (params.logprobs set)."""
    engine.add_request(EngineRequest(rid, prompt, params, **request))
    logprobs: list[TokenLogprobs] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                logprobs += out.new_logprobs
                final = out if out.finished else final
    assert final is not None, f"{rid} never finished"
    return final, logprobs


def as_tuples(logprobs: list[TokenLogprobs]) -> list[tuple]:
    """Every field of each token's logprobs, to compare bit for bit."""
    return [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in logprobs]


def max_logprob_diff(a: list[TokenLogprobs], b: list[TokenLogprobs]) -> float:
    """The largest difference between a and b's logprobs, of the sampled tokens and of their
    top alternatives (a and b must have sampled the same tokens)."""
    assert [lp.token_id for lp in a] == [lp.token_id for lp in b]
    diffs = [abs(x.logprob - y.logprob) for x, y in zip(a, b)]
    diffs += [abs(u[1] - v[1]) for x, y in zip(a, b) for u, v in zip(x.top, y.top)]
    return max(diffs)
