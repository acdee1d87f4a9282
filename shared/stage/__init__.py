"""The engine-stage skeleton: what the services that run an engine (prefill,
decode) share on top of the plumbing in shared/runtime: the engine on its
thread with heartbeats, KV events and the drain (worker.py), and engine
dataclasses <-> protobuf (convert.py, also the balancer's)."""
