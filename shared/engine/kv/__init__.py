"""The engine's KV management: the block pool, one manager per KV cache group
and the coordinator over them, the host-memory state cache of sliding-window KV,
and the connector interface through which KV comes from and goes to outside
sources (the kvcache service). No tensors here: block ids index the model
runner's cache tensors."""
