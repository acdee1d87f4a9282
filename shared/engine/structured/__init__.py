"""Structured outputs (JSON schema, regex, choice, EBNF, structural tags) with xgrammar:
spec.py what a request asks for (plain data, on the wire), grammar.py checking and
compiling it over the model's vocabulary (cached by content hash), compile_pool.py
compiling off the engine thread while the request waits, matcher.py one
request's matcher, apply.py the sampler's masks, setup.py the engine's side."""
