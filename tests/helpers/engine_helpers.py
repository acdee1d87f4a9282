"""Driving one engine request to its end, for the tests that check what it returns."""

from typing import Any

from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
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
