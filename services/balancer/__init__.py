"""The balancer: the OpenAI-compatible front door, the registry of live
instances, one routing policy per stage, and the orchestration of each request
through prefill and decode."""
