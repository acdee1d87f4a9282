"""The engine's KV memory: the block pool, one manager per KV cache group and the
coordinator over them (what the scheduler allocates, frees and finds cached; no
tensors: block ids index the model runner's cache tensors), the host-memory
state cache of sliding-window KV, the paged cache as a region of blocks that
connectors read and write (region.py, the one KVRegion) and the share of that
cache with another process on this host (share.py)."""
