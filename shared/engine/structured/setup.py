"""The engine's side of structured outputs: one compiler per engine (over its model's
vocabulary), requests checked at admission and their grammars compiled on a pool, a matcher per running request."""

from concurrent.futures import Future
from typing import Any

from shared.engine.sampling_params import SamplingParams
from shared.engine.structured.compile_pool import GrammarCompilePool
from shared.engine.structured.grammar import GrammarCompiler
from shared.engine.structured.matcher import GrammarState
from shared.recipe import Recipe


def make_grammar_compiler(recipe: Recipe | None, vocab_size: int, eos_token_ids: frozenset[int]) -> GrammarCompiler | None:
    """None for a checkpoint without a tokenizer: its requests cannot be structured."""
    if recipe is None:
        return None
    return GrammarCompiler(recipe.backend, vocab_size, eos_token_ids, recipe.all_special_ids - eos_token_ids)


def check_structured(params: SamplingParams, pool: GrammarCompilePool | None) -> "Future[Any] | None":
    """At admission: check the request's grammar (a ValueError if it is invalid) and start
    its compile on the pool's thread; the future of that compile, None when there is
    nothing to wait for (no grammar, or one compiled already)."""
    if params.structured is None:
        return None
    if pool is None:
        raise ValueError("structured outputs need a tokenizer; this checkpoint has none")
    return pool.submit(params.structured)


def grammar_state(params: SamplingParams, compiler: GrammarCompiler | None) -> GrammarState | None:
    """A fresh matcher for a request the runner starts (or restarts after a handoff)."""
    if params.structured is None:
        return None
    assert compiler is not None, "check_structured admitted a structured request without a compiler"
    return GrammarState.create(compiler.compile(params.structured), compiler.stop_token_ids)
