"""KV groups and SWA replay on a GPU: the Triton kernels, CUDA graphs with one
block table per group, and async scheduling (run on the device machine:
`python -m pytest -q tests/gpu`). float32, so that an exact replay must give a
cold run's tokens bit for bit."""

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.transfer import KVTransferParams
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.engine_helpers import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)



@pytest.mark.parametrize("layer_types", [["full_attention", "sliding_attention"] * 2, ["sliding_attention", "full_attention", "sliding_attention"]])
def test_exact_replay_equals_a_cold_run_on_the_gpu(tmp_path, layer_types):
    save_tiny_hf_model(
        "qwen2", tmp_path, num_hidden_layers=len(layer_types), layer_types=layer_types,
        use_sliding_window=True, sliding_window=6, max_window_layers=0,
    )  # fmt: skip
    cfg = dict(model=str(tmp_path), block_size=4, device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 500, (70,), generator=g).tolist()
    cold_engine = LLMEngine(EngineConfig(**cfg))
    assert cold_engine.runner.graphs is not None  # decode steps replay graphs with one table per group
    cold = run(cold_engine, "cold", prompt, GREEDY)
    store = MemoryKVStore()
    producer = LLMEngine(EngineConfig(**cfg), kv_connector=MemoryConnector(store))
    run(producer, "p", prompt[:60], SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))
    consumer = LLMEngine(EngineConfig(**cfg, swa_replay="exact"), kv_connector=MemoryConnector(store))
    out = run(consumer, "c", prompt, GREEDY, kv_transfer=KVTransferParams(load=True))
    assert out.kv.num_loaded_blocks == 15 and consumer.kv.num_replays == 1
    assert out.token_ids == cold.token_ids
    # And the same with the graphs off: graphs change nothing.
    eager = run(LLMEngine(EngineConfig(**cfg, cuda_graphs=False)), "e", prompt, GREEDY)
    assert eager.token_ids == cold.token_ids
