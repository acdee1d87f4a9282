"""The balancer: two services in one process. frontend/ is the OpenAI-compatible
front door (HTTP, request bodies, tools, streaming); router/ is the mesh router
(the registry of live instances, one routing policy per stage, and the
orchestration of each request through prefill and decode). They meet only at
generation.py (the Generator contract the front door calls and the router, or
local.py's in-process engine, implements); service.py wires them together."""
