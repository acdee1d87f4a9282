"""The mesh tier (marker `mesh`): tests that start real processes, a nats-server,
service processes (kvcache, prefill, decode, the balancer) or whole meshes, on free
ports. Modules run in parallel workers where they are safe beside another (see
tests/mesh/conftest.py for the ones kept serial)."""
