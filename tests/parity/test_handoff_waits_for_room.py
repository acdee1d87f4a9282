"""A decode handoff that arrives while decode's pool is full waits for blocks to come free
and then copies prefill's KV; it never computes the prompt prefill already computed
(shared/engine/scheduler.py, Scheduler._kv_wait). Before, such a handoff was admitted as a
fresh prompt once room came, and decode recomputed it whole while prefill's lease held the
same KV: in an 8k-prompt run on one H100 (1, 4 and 16 clients) 34 of 126 handoffs did."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.request import RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.peer import PeerConnector
from shared.kv.transfer import KVTransferParams, PeerSource
from tests.helpers.engine_helpers import generate
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

BLOCK = 4
HOLD = KVTransferParams(load=True, save=True, wait_for_save=False, hold=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Decode's pool: 16 blocks; the busy request holds 11 (44 prompt tokens) and grows to 13,
# so the handoff's 7 blocks find no room until it ends.
DECODE = dict(block_size=BLOCK, num_kv_blocks=16, max_model_len=64)
BUSY, PROMPT = random_prompts([44, 28], vocab=500, seed=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("room"), seed=2))


def test_a_handoff_without_room_waits_and_copies_instead_of_recomputing(model: str) -> None:
    one, _ = generate(LLMEngine(EngineConfig(model=model, block_size=BLOCK)), "one", PROMPT, GREEDY)
    released: list[str] = []
    prefill = LLMEngine(EngineConfig(model=model, block_size=BLOCK), kv_connector=MemoryConnector(MemoryKVStore()),
                        share_kv=True)  # fmt: skip
    decode = LLMEngine(EngineConfig(model=model, **DECODE),
                       kv_connector=PeerConnector(MemoryConnector(MemoryKVStore()), lambda peer, rid: released.append(rid)))  # fmt: skip
    try:
        first, _ = generate(prefill, "r", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
        held = first.kv.held  # type: ignore[union-attr]
        assert held is not None and held.num_blocks == len(PROMPT) // BLOCK
        region = prefill.runner.kv_region
        source = PeerSource("prefill-0", region.share(), held.block_ids, held.num_blocks, held.deadline, region.layout,
                            held.window_first, held.window)  # fmt: skip
        decode.add_request(EngineRequest("busy", BUSY, GREEDY))
        decode.step()  # busy's prompt takes 11 of the 16 blocks
        decode.add_request(EngineRequest("r", PROMPT, GREEDY, resume_token_ids=first.token_ids,
                                         kv_transfer=KVTransferParams(load=True, source=source)))  # fmt: skip
        waited = 0
        outs: dict[str, RequestOutput] = {}
        while decode.has_unfinished_requests():
            request = decode.scheduler.requests.get("r")
            if request is not None and "busy" not in outs:
                # While busy runs the handoff neither computes nor loads: it waits for room.
                assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
                waited += request.kv_awaits_room
            outs.update((o.request_id, o) for o in decode.step() if o.finished)
        out = outs["r"]
        assert waited > 0, "the handoff found room at once: the test's pool is too large"
        assert out.kv is not None and out.kv.loaded_direct and out.kv.load_path == "peer"
        assert out.kv.num_loaded_blocks == held.num_blocks and not out.kv.load_failed
        assert released == ["r"] and out.token_ids == one.token_ids
    finally:
        decode.close()
        prefill.close()
