"""The Block KVCache service: an LMDB-backed, content-addressed store of KV
blocks (store.py) behind a gRPC streaming API (servicer.py), started by
``python -m services.kvcache`` (__main__.py). Clients use shared/kv/wire/client.py."""
