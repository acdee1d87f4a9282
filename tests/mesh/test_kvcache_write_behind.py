"""Saves written behind to a real kvcache process: the engine's blocks come back
as soon as the connector has read them, whatever the store is doing, and what
the connector drops under pressure is counted."""

import asyncio
import os
import signal
import time


from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockHash
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.transfer import KVTransferParams
from shared.kv.wire.client import KVCacheClient
from tests.helpers.engine_helpers import run
from tests.helpers.hf_models import random_prompts

WRITE_BEHIND = KVTransferParams(save=True, wait_for_save=False)
BLOCK = 8


TINY_MODEL = "llama"
"""The model of model_dir (the root conftest's fixture)."""


def stored_blocks(address: str, hashes: list[BlockHash]) -> int:
    async def ask() -> int:
        client = KVCacheClient(address, timeout_s=5)
        try:
            return await client.lookup(hashes)
        finally:
            await client.close()

    return asyncio.run(ask())


def full_block_hashes(engine: LLMEngine, out) -> list[BlockHash]:  # noqa: ANN001
    return out.kv.block_hashes[: len(out.prompt_token_ids) // BLOCK]


def test_a_save_written_behind_gives_the_blocks_back_while_the_store_is_stalled(model_dir, kvcache):
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=64),
                       kv_connector=KVCacheConnector(kvcache.address))  # fmt: skip
    prompt = random_prompts([45], vocab=500, seed=31)[0]
    os.kill(kvcache.proc.pid, signal.SIGSTOP)  # the store takes nothing in
    try:
        started = time.monotonic()
        out = run(engine, "a", prompt, SamplingParams(max_tokens=1), kv_transfer=WRITE_BEHIND)
        # Reported once read: the request ended at once, and the engine holds none of its
        # blocks (all free, the prompt's cached for a later hit), though nothing is stored yet.
        assert time.monotonic() - started < 10
        assert engine.kv.pool.num_free_blocks == 64
        assert not engine.has_unfinished_requests()
    finally:
        os.kill(kvcache.proc.pid, signal.SIGCONT)
    hashes = full_block_hashes(engine, out)
    deadline = time.monotonic() + 10
    while stored_blocks(kvcache.address, hashes) < len(hashes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stored_blocks(kvcache.address, hashes) == len(hashes) == 45 // BLOCK  # the store ran on
    assert engine.load().num_kv_saves_dropped == 0 and engine.load().num_kv_save_failures == 0
    engine.close()


def test_a_save_beyond_the_bytes_on_their_way_is_dropped_and_counted(model_dir, kvcache, monkeypatch):
    monkeypatch.setattr("shared.kv.connectors.kvcache.MAX_BYTES_BEHIND", 1)  # no room for any block
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK), kv_connector=KVCacheConnector(kvcache.address))
    prompt = random_prompts([40], vocab=500, seed=32)[0]
    out = run(engine, "b", prompt, SamplingParams(max_tokens=1), kv_transfer=WRITE_BEHIND)
    assert out.kv.save_error is None
    deadline = time.monotonic() + 10
    while engine.load().num_kv_saves_dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.load().num_kv_saves_dropped == 1
    assert stored_blocks(kvcache.address, full_block_hashes(engine, out)) == 0
    # A save the request waits for is never dropped: it is reported once stored.
    waited = run(engine, "c", prompt, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))
    assert waited.kv.num_saved_blocks == 40 // BLOCK and waited.kv.save_error is None
    assert stored_blocks(kvcache.address, full_block_hashes(engine, waited)) == 40 // BLOCK
    engine.close()


def test_saves_run_in_a_writer_process_when_the_cache_can_be_mapped(model_dir, kvcache):
    """A cache other processes can map (a prefill worker's, in shared memory here): the
    byte work of its saves runs in the writer process, the blocks land in kvcache, and
    a writer that dies turns later saves into counted failures, never a stuck engine."""
    connector = KVCacheConnector(kvcache.address)
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=64),
                       kv_connector=connector, share_kv=True)  # fmt: skip
    prompt = random_prompts([45], vocab=500, seed=33)[0]
    out = run(engine, "w", prompt, SamplingParams(max_tokens=1), kv_transfer=WRITE_BEHIND)
    writer = connector._writer
    assert writer is not None and writer.alive and writer._proc.pid != os.getpid()
    hashes = full_block_hashes(engine, out)
    deadline = time.monotonic() + 10
    while stored_blocks(kvcache.address, hashes) < len(hashes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stored_blocks(kvcache.address, hashes) == len(hashes) == 45 // BLOCK
    # A save the request waits for goes through the writer too, and is reported once stored.
    other = random_prompts([33], vocab=500, seed=34)[0]
    waited = run(engine, "v", other, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))
    assert waited.kv.num_saved_blocks == 33 // BLOCK and waited.kv.save_error is None
    assert stored_blocks(kvcache.address, full_block_hashes(engine, waited)) == 33 // BLOCK

    writer._proc.kill()
    writer._proc.wait()
    deadline = time.monotonic() + 10
    while writer.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not writer.alive
    third = random_prompts([41], vocab=500, seed=35)[0]
    failed = run(engine, "x", third, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))
    # With the writer gone the connector saves in this process again: the store still happens.
    assert failed.kv.save_error is None and failed.kv.num_saved_blocks == 41 // BLOCK
    assert engine.kv.pool.num_free_blocks == 64
    engine.close()


def test_a_flush_gives_up_on_a_stalled_store_after_its_bound_and_counts_its_blocks(model_dir, kvcache):
    """What a stopping worker's flush does when kvcache takes nothing in: it waits its
    bound (worker.kv_flush_timeout_s), no longer, and counts the blocks still on their way."""
    connector = KVCacheConnector(kvcache.address, probe_interval_s=3600)  # never marked down meanwhile
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=64), kv_connector=connector)
    prompt = random_prompts([45], vocab=500, seed=36)[0]
    os.kill(kvcache.proc.pid, signal.SIGSTOP)
    try:
        run(engine, "f", prompt, SamplingParams(max_tokens=1), kv_transfer=WRITE_BEHIND)
        started = time.monotonic()
        assert connector.flush(0.5) == 45 // BLOCK
        assert time.monotonic() - started >= 0.5
        assert connector.num_blocks_unflushed == 45 // BLOCK
    finally:
        os.kill(kvcache.proc.pid, signal.SIGCONT)
    engine.close()


def test_a_save_written_behind_is_stored_when_the_connector_is_flushed_and_closed_at_once(model_dir, kvcache):
    """The stop of a worker whose saves run in its own process (decode's, a cache no other
    process maps): flushed, then closed right after the request ended, the blocks are in
    kvcache (close alone ends the connector's loop with the store on its way)."""
    for share_kv, seed in ((False, 37), (True, 38)):
        connector = KVCacheConnector(kvcache.address)
        engine = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=64),
                           kv_connector=connector, share_kv=share_kv)  # fmt: skip
        prompt = random_prompts([45], vocab=500, seed=seed)[0]
        out = run(engine, "s", prompt, SamplingParams(max_tokens=1), kv_transfer=WRITE_BEHIND)
        assert connector.flush(60.0) == 0  # a generous bound: the store lands long before it
        engine.close()
        assert stored_blocks(kvcache.address, full_block_hashes(engine, out)) == 45 // BLOCK, share_kv
        assert connector.num_blocks_unflushed == 0 and connector.num_save_failures_behind == 0
