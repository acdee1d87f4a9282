"""Which identity of the mesh may call which kvcache method (the table that
shared/runtime/rpc_auth.py's check applies; identities are the callers'
tokens, worker.grpc_peers).

Blocks are KV the workers compute: only prefill and decode store them (a forged
block under a prompt's hash would be served to every later request with that
prefix) and only they read them. Blobs are the vision stage's image embeddings:
vision stores them, and vision, prefill and decode read them. Stats tell sizes
only: any identity of the mesh. Anything else (a method added later and not
named here, any identity not named for a method) is PERMISSION_DENIED."""

from shared.proto import kvcache_pb2
from shared.runtime.rpc_auth import Access

_SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"]
WORKERS = frozenset({"prefill", "decode"})
"""The identities that compute KV."""
MESH = frozenset({"prefill", "decode", "vision", "balancer"})

_BY_METHOD = {
    "Put": WORKERS,
    "PutShm": WORKERS,
    "Get": WORKERS,
    "Lookup": WORKERS,
    "PutBlobs": frozenset({"vision"}),
    "GetBlobs": WORKERS | {"vision"},
    "Stats": MESH,
}

ACCESS: Access = {f"/{_SERVICE.full_name}/{m.name}": _BY_METHOD.get(m.name, frozenset()) for m in _SERVICE.methods}
"""Full method name -> the identities that may call it (every method of the service, unnamed ones: nobody)."""
