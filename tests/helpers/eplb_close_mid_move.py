"""Close an expert-parallel engine (2 gloo ranks, EPLB) while a layer's move is in
flight, as its own process (tests/parity/test_expert_parallel_engine.py runs it and
reads its exit code and stderr): ``python -m tests.helpers.eplb_close_mid_move MODEL``.
Rank 0's move is held until the engine's close() began, so that the ranks' movers are
in their collectives while the engine closes: a mover left running there had a worker
abort at exit ("terminate called without an active exception"). Prints ``closed
mid-move`` once close() returned."""

import json
import sys
import threading
from typing import Any

from shared.engine.engine_request import EngineRequest
from shared.engine.executor import expert_mover
from shared.engine.llm import LLM
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import random_prompts

ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24, tensor_parallel_size=2,
              enable_expert_parallel=True, enable_eplb=True)  # fmt: skip
EPLB = {"window_size": 4, "step_interval": 2, "num_redundant_experts": 2}
MAX_STEPS = 60


def main(model: str) -> None:
    closing = threading.Event()
    move, close = expert_mover.move_layer_weights, LLMEngine.close

    def held_move(*args: Any) -> Any:  # rank 0's mover thread (this process)
        closing.wait(timeout=30.0)
        return move(*args)

    def marked_close(self: LLMEngine) -> None:
        closing.set()
        close(self)

    expert_mover.move_layer_weights = held_move
    LLMEngine.close = marked_close  # type: ignore[method-assign]
    engine = LLM(model, eplb_config=json.dumps(EPLB), **ENGINE).engine
    params = SamplingParams(max_tokens=MAX_STEPS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([5, 17], vocab=500, seed=4)):
        engine.add_request(EngineRequest(str(i), prompt, params))
    moves = engine.executor.moves  # type: ignore[attr-defined]
    for _ in range(MAX_STEPS):
        if moves.in_flight is not None:
            break
        engine.step()
    if moves.in_flight is None:
        sys.exit(f"no move in flight after {MAX_STEPS} steps")
    engine.close()
    print("closed mid-move", flush=True)


if __name__ == "__main__":  # the ranks are spawned: they import this module, and must not run it
    main(sys.argv[1])
