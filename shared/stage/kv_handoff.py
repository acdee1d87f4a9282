"""What prefill and decode ask of the engine's KV connector, and what a handoff
between them says about KV, in one place: the services dispatch, hand off and
stream, and build no KV descriptor themselves.

- Prefill loads what the chain holds and saves the prompt's new full blocks.
  With direct transfer (a peer can map this engine's cache, or read it through
  NIXL) it holds them under a lease for decode and writes kvcache behind, off
  the time to first token; without, its last output waits for the store and
  decode reads kvcache.
- The handoff's KvSource says which blocks prefill holds (per persistent group,
  group after group, and the sliding groups' window at the held boundary), how to
  map its cache (KVRegion.share(), on this host) and how to read it through NIXL
  (NixlConnector.describe()), and the payload's layout; decode turns it back into
  a PeerSource and loads from there, or from the chain when it cannot use it.
- A whole request on decode loads what the chain holds and writes behind.
"""

from shared.engine.llm_engine import LLMEngine
from shared.kv.transfer import HeldBlocks, KVTransferParams, PeerSource
from shared.proto import mesh_pb2


def prefill_transfer(engine: LLMEngine, nixl: bool = False) -> KVTransferParams:
    """Prefill's request: load, save, and hold for decode where a peer can read the
    cache (mapped on this host, or through NIXL: `nixl`, this engine has an agent)."""
    direct = engine.runner.shares_kv or nixl
    return KVTransferParams(load=True, save=True, wait_for_save=not direct, hold=direct)


def handoff_transfer(engine: LLMEngine, handoff: mesh_pb2.DecodeHandoff) -> KVTransferParams:
    """Decode's request after a handoff: load, from prefill's cache when it holds the blocks."""
    return KVTransferParams(load=True, source=peer_source(engine, handoff))


def whole_request_transfer() -> KVTransferParams:
    """A whole request on decode (conditional disaggregation): load, and save written behind."""
    return KVTransferParams(load=True, save=True, wait_for_save=False)


def held_kv_source(
    engine: LLMEngine, instance_id: str, held: HeldBlocks | None, nixl: bytes = b""
) -> mesh_pb2.KvSource | None:
    """The handoff's description of the prompt blocks this engine holds for decode;
    None when it holds none. nixl: how to read them through NIXL (the engine's
    NixlConnector.describe()), empty without."""
    if held is None or not held.num_blocks:
        return None
    region = engine.kv_region  # every rank's cache, for a multi-rank instance
    return mesh_pb2.KvSource(
        instance_id=instance_id,
        region=region.share() if engine.runner.shares_kv else b"",
        nixl=nixl,
        block_ids=[b for g in sorted(held.block_ids) for b in held.block_ids[g]],
        num_blocks=held.num_blocks,
        lease_deadline_unix=held.deadline,
        layout=region.layout,
        window_first=held.window_first,
        window_block_ids=[b for g in sorted(held.window) for b in held.window[g]],
    )


def peer_source(engine: LLMEngine, handoff: mesh_pb2.DecodeHandoff) -> PeerSource | None:
    """Where prefill holds the prompt's KV for a direct copy, if it does."""
    if not handoff.HasField("kv_source") or handoff.kv_source.num_blocks == 0:
        return None
    src = handoff.kv_source
    groups = engine.kv.layout.persistent_groups
    n = src.num_blocks
    if len(src.block_ids) != n * len(groups):
        return None  # another model's layout: kvcache serves it
    ids = list(src.block_ids)
    block_ids = {g: ids[i * n : (i + 1) * n] for i, g in enumerate(groups)}
    first, window = _window(src, engine.kv.layout.sliding_groups)
    return PeerSource(src.instance_id, src.region, block_ids, n, src.lease_deadline_unix, src.layout, first, window, nixl=src.nixl)


def _window(src: mesh_pb2.KvSource, groups: tuple[int, ...]) -> tuple[int, dict[int, list[int]]]:
    """(window_first, per sliding group its block ids); (0, {}) when the handoff carries
    none or one that does not fit this model's sliding groups (decode then replays)."""
    w = src.num_blocks - src.window_first
    ids = list(src.window_block_ids)
    if not groups or not ids or w <= 0 or len(ids) != w * len(groups):
        return 0, {}
    return src.window_first, {g: ids[i * w : (i + 1) * w] for i, g in enumerate(groups)}
