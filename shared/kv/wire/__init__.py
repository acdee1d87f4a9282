"""The kvcache service's wire, torch-free and engine-free: the client workers use
(client.py), the shared-memory segment through which client and service move
blocks on one host (shm.py), and the block stream that cuts blocks into gRPC
chunks and assembles them back (block_stream.py), used by both ends."""
