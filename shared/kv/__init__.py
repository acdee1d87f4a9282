"""The KV system, in one place: what names a block, where the engine keeps it,
and every path a block takes in and out of an engine.

- The vocabulary (plain data, torch-free, imports nothing of the project but
  shared.proto): `block_hash.py` (the chained content address of a block: the
  prefix-cache key, the store's key, the routing key), `spec.py` (the KV groups a
  model declares and the layout of a block's payload), `transfer.py` (what a
  request asks of the connector, and the blocks a finished one holds for a
  peer), `events.py` (the block events a worker publishes for cache-aware routing).
- `memory/`: the engine's KV memory: the block pool, one manager per KV group and
  the coordinator over them, the host state cache of sliding-window KV, the paged
  cache as a region of blocks (`region.py`, the one `KVRegion`) and its share
  with another process on the host (`share.py`).
- `connectors/`: the interface every outside source and sink of KV implements
  (`base.py`), one file per connector, and `chain.py`, which orders them for a
  mesh worker.
- `wire/`: the kvcache service's wire, torch-free: the client, the shared-memory
  segment and the block stream (the service is services/kvcache/).

The engine's side of a transfer (which blocks a load or save moves, and who holds
them meanwhile) is engine scheduling and sits with the engine:
shared/engine/kv_transfer.py. What a handoff between stages says about KV is
converted in the stage skeleton: shared/stage/kv_handoff.py.

A block's way, in order: the prefill engine computes it into a block of its
pool (memory/) and names it by its chain hash (block_hash.py); when the request
ends, the engine saves the prompt's full blocks through the chain
(connectors/chain.py): kept in the host tier and written behind to kvcache
(connectors/kvcache.py over wire/), and, with direct transfer, held under a
lease for decode. Decode asks the same chain at admission: first a direct copy
out of the prefill engine's cache on this host (connectors/peer.py), then the
host tier (connectors/host_tier.py), then kvcache; what none holds is
recomputed. Meanwhile both engines publish the hashes they hold (events.py), by
which the balancer routes a prompt to the cache that holds its prefix.
"""
