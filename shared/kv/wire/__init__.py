"""The wires under the connectors, torch-free and engine-free. The kvcache
service's: the client workers use (client.py), the shared-memory segment through
which client and service move blocks on one host (shm.py), and the block stream
that cuts blocks into gRPC chunks and assembles them back (block_stream.py), used
by both ends. And NIXL's: one agent per process that registers the KV cache and
reads a peer's (nixl.py)."""
