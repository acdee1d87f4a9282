"""The KV writer process on the GPU (run on the device machine: `python -m pytest -q
tests/gpu`): a prefill-like engine whose cache lives on the card saves a prompt's
blocks written behind; the writer, a process of its own, maps the cache by CUDA
IPC, reads the blocks and stores them in a real kvcache process. What kvcache then
holds must be, byte for byte, the blocks in the engine's cache."""

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.transfer import KVTransferParams
from shared.kv.wire.client import KVCacheClient
from tests.helpers.engine_helpers import run
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model
from tests.helpers.kvcache_proc import KVCacheProc, serving_kvcache
from tests.helpers.mesh_procs import NatsServer
from tools.bench.tier_bench import prefix_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK = 16


@pytest.fixture(scope="module")
def kvcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVCacheProc]:
    """A kvcache process serving against a nats-server of this module's own. Made here,
    not taken from tests/conftest.py: the device runs tests/gpu with --noconftest."""
    nats = NatsServer(tmp_path_factory.mktemp("nats"))
    try:
        with serving_kvcache(nats.url, tmp_path_factory.mktemp("kvcache")) as svc:
            yield svc
    finally:
        nats.stop()


def test_the_writer_process_stores_the_cards_blocks_byte_for_byte(tmp_path, kvcache):
    save_tiny_hf_model("llama", tmp_path / "model")
    connector = KVCacheConnector(kvcache.address)
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "model"), device="cuda", dtype="bfloat16",
                                    block_size=BLOCK, num_kv_blocks=128),
                       kv_connector=connector, share_kv=True)  # fmt: skip
    try:
        prompt = random_prompts([8 * BLOCK + 5], vocab=500, seed=41)[0]
        out = run(engine, "w", prompt, SamplingParams(max_tokens=1),
                  kv_transfer=KVTransferParams(save=True, wait_for_save=False))  # fmt: skip
        writer = connector._writer
        assert writer is not None and writer.alive and writer._proc.pid != os.getpid()
        hashes = out.kv.block_hashes[:8]

        async def fetch() -> list:
            async with KVCacheClient(kvcache.address, timeout_s=10) as client:
                deadline = time.monotonic() + 20
                while await client.lookup(hashes) < len(hashes) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                return await client.get_blocks(hashes)

        stored = asyncio.run(fetch())
        assert len(stored) == 8
        on_card = prefix_kv(engine, out, 8)  # the prompt's blocks as the engine's prefix cache holds them
        assert on_card is not None and on_card.shape[0] == 8
        for i, (block_hash, _, data) in enumerate(stored):
            assert block_hash == hashes[i]
            assert data == on_card[i].numpy().tobytes(), f"block {i}: kvcache holds other bytes than the card"
        assert engine.kv.pool.num_free_blocks == 128
    finally:
        engine.close()
