"""The engine-stage skeleton: what the services that run an engine (prefill,
decode) share on top of the plumbing in shared/runtime: the engine on its
thread with its KV connector chain, heartbeats, KV events, admission and the
drain (worker.py), what a handoff says about KV (kv_handoff.py), and engine
dataclasses <-> protobuf (convert.py, also the balancer's)."""
