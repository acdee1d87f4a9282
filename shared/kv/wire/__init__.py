"""The wires under the connectors, torch-free and engine-free. The kvcache
service's: the client workers use (client.py), the shared-memory segment through
which client and service move blocks on one host (shm.py), and the block stream
that cuts blocks into gRPC chunks and assembles them back (block_stream.py), used
by both ends; the one stats type the store, the Stats RPC and the client share
(stats.py); the NIXL landing buffer kvcache writes a client's Gets into where
shared memory cannot reach (nixl_plane.py), and which plane each Get lands on
(targets.py: shared memory, NIXL, the byte stream). And NIXL itself: one agent
per process that registers the KV cache and reads a peer's (nixl.py)."""
