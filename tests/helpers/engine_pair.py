"""A prefill engine and a decode engine over one in-memory store, as the KV transfer
tests build them (tests/unit/test_peer_transfer.py, test_nixl_transfer.py): both on
model_dir's tiny model with blocks of 8 and leases of lease_s; prefill holds a
finished request's blocks for a peer (HOLD), decode resumes the request loading them
through its connector, with the store as the link behind. What each transport adds is
its two connectors, made over `store` by the subclass, and the PeerSource its handoff
carries (source())."""

from abc import ABC, abstractmethod

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.base import KVConnector
from shared.kv.connectors.memory import MemoryKVStore
from shared.kv.transfer import HeldBlocks, KVTransferParams, PeerSource
from tests.helpers.engine_helpers import run

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HOLD = KVTransferParams(load=True, save=True, wait_for_save=False, hold=True)
"""Prefill's request: save, and hold the blocks for a peer under a lease."""
BLOCK_SIZE = 8


class EnginePair(ABC):
    """prefill (with prefill_connector) and decode (with decode_connector, as `connector`)."""

    def __init__(
        self,
        model_dir: str,
        store: MemoryKVStore,
        prefill_connector: KVConnector,
        decode_connector: KVConnector,
        lease_s: float = 10.0,
        share_kv: bool = False,
    ) -> None:
        self.store = store
        config = dict(model=model_dir, block_size=BLOCK_SIZE, kv_lease_timeout_s=lease_s)
        self.prefill = LLMEngine(EngineConfig(**config), kv_connector=prefill_connector, share_kv=share_kv)
        self.connector = decode_connector
        self.decode = LLMEngine(EngineConfig(**config), kv_connector=decode_connector)

    @abstractmethod
    def source(self, held: HeldBlocks) -> PeerSource:
        """The PeerSource prefill's handoff names for blocks it holds."""

    def resume(
        self, rid: str, prompt: list[int], first: RequestOutput, source: PeerSource | None = None
    ) -> RequestOutput:
        """Decode resumes prefill's request (its output `first`) greedily, loading the
        prompt's KV from `source`: by default the blocks prefill holds for it."""
        source = self.source(first.kv.held) if source is None else source
        return run(self.decode, rid, prompt, GREEDY, resume_token_ids=first.token_ids,
                   kv_transfer=KVTransferParams(load=True, source=source))  # fmt: skip

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
