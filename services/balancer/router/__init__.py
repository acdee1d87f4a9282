"""The balancer's mesh router: the registry of live instances fed by
heartbeats (registry.py) and NATS departures (departures.py), the routing
policy per stage (policies.py), and MeshGenerator (orchestrator.py), the
services.balancer.generation.Generator that hands each request to a prefill
and a decode instance over NATS and fails it over when one fails. It knows no
HTTP nor OpenAI body."""
