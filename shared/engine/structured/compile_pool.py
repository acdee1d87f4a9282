"""Grammars compiled off the engine thread.

Compiling a grammar over a large vocabulary takes xgrammar seconds; done on the
engine thread at admission it stalled every running request for that long. The
engine owns one GrammarCompilePool: admission builds the grammar (cheap, and the
ValueError of a bad one still reaches the caller as before), hands the compile
to the pool's worker and the request waits in WAITING_FOR_GRAMMAR, which the
scheduler passes over until the compile is done (vLLM v1 does the same). A spec
the compiler's LRU already holds, or one being compiled for another request,
costs no second compile.
"""

import concurrent.futures
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from shared.engine.structured.grammar import GrammarCompiler, build_grammar
from shared.engine.structured.spec import StructuredSpec


class GrammarCompilePool:
    def __init__(self, compiler: GrammarCompiler, max_workers: int = 1) -> None:
        """max_workers: compiles at once (one: xgrammar parallelises a compile itself
        where it can, and a second thread would only take cores from the step)."""
        self.compiler = compiler
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._compiling: dict[str, Future[Any]] = {}
        """Compiles on their way, by spec key: a second request with the spec shares the first's."""
        self._lock = threading.Lock()

    def submit(self, spec: StructuredSpec) -> "Future[Any] | None":
        """None when spec's grammar is compiled already; else the future of its compile.
        Raises ValueError (here, on the caller's thread) when spec is invalid."""
        if self.compiler.cached(spec) is not None:
            return None
        with self._lock:
            future = self._compiling.get(spec.key)
            if future is not None:
                return future
        grammar = build_grammar(spec)  # the checks: a bad grammar fails admission, not later
        with self._lock:
            future = self._compiling.get(spec.key)
            if future is not None:
                return future
            future = self._executor.submit(self.compiler.compile_built, spec, grammar)
            self._compiling[spec.key] = future
        # Outside the lock: on a compile already done the callback runs at once, here.
        future.add_done_callback(lambda _f, key=spec.key: self._done(key))
        return future

    def _done(self, key: str) -> None:
        with self._lock:
            self._compiling.pop(key, None)

    @staticmethod
    def wait(futures: list["Future[Any]"], timeout_s: float) -> None:
        """Block until one of futures is done or timeout_s passed (an engine with nothing
        else to do waits here instead of spinning through empty steps)."""
        concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
