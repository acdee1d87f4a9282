"""The balancer's OpenAI-compatible front door: the HTTP app (api.py), the
request and response bodies (protocol.py names them all), one request's flow
from checks through admission to the answer (serving.py, jobs.py, choices.py,
pump.py, event_stream.py), its errors, metrics and guard, and tool calling
(tool_*.py and the output parsers in tool_parsers/). It knows no NATS nor
instance: it drives any services.balancer.generation.Generator."""
