"""Grammars compile on the engine's pool, off the step (shared/engine/structured/compile_pool.py):
while one compiles, the running requests go on decoding and the structured request waits
in WAITING_FOR_GRAMMAR; it then decodes exactly as it would have had its grammar been
compiled already; one compile per spec; a failed compile ends its request alone."""

import re
import threading
from typing import Any

import pytest

from shared.engine.engine_request import EngineRequest
from shared.engine.llm import LLM
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.request import RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured.grammar import GrammarCompiler
from shared.engine.structured.spec import StructuredSpec

PLAIN = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(mesh_model_dir: str) -> LLM:
    # Batch-invariant: a request's greedy tokens do not depend on what it was batched with.
    return LLM(mesh_model_dir, batch_invariant=True)


def _spec(name: str) -> StructuredSpec:
    """A grammar no other test compiled (a cache miss), short enough to complete."""
    return StructuredSpec("regex", name + r"=[0-9]{1,3};")


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return tokens


class Gate:
    """compile_built held until opened, recording the thread each compile ran on."""

    def __init__(self, compiler: GrammarCompiler, fail: bool = False) -> None:
        self.compiler, self.fail = compiler, fail
        self.opened = threading.Event()
        self.threads: list[str] = []
        self._real = compiler.compile_built

    def __call__(self, spec: StructuredSpec, grammar: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        assert self.opened.wait(60), "the gate was never opened"
        if self.fail:
            raise RuntimeError("xgrammar refused it")
        return self._real(spec, grammar)


@pytest.fixture
def gate(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Gate:
    compiler = llm.engine.runner.structured.compiler
    assert compiler is not None
    g = Gate(compiler)
    monkeypatch.setattr(compiler, "compile_built", g)
    return g


def test_running_requests_decode_while_a_grammar_compiles(llm: LLM, gate: Gate) -> None:
    engine = llm.engine
    for i in range(4):
        engine.add_request(EngineRequest(f"plain-{i}", f"def f{i}(x):", PLAIN))
    for _ in range(3):
        engine.step()
    spec = _spec("stalled")
    structured = SamplingParams(max_tokens=40, temperature=0.0, structured=spec)
    engine.add_request(EngineRequest("json", "value = ", structured))  # returns: the compile is not here
    request = engine.scheduler.requests["json"]
    assert request.status == RequestStatus.WAITING_FOR_GRAMMAR
    emitted: list[RequestOutput] = []
    for _ in range(10):  # the batch goes on while the compile is held
        emitted += engine.step()
    assert {o.request_id for o in emitted} == {f"plain-{i}" for i in range(4)}
    assert sum(len(o.new_token_ids) for o in emitted) >= 4 * 10 - 4  # every step decoded all four
    assert request.status == RequestStatus.WAITING_FOR_GRAMMAR and request.num_computed_tokens == 0
    assert gate.threads and all(name.startswith("grammar-compile") for name in gate.threads)
    gate.opened.set()
    tokens = _run(engine)
    assert engine.scheduler.requests.get("json") is None and "json" in tokens
    # The same request once its grammar is cached (no wait): the same tokens.
    again = llm.generate(["value = "], SamplingParams(max_tokens=40, temperature=0.0, structured=spec))[0]
    assert again.token_ids == tokens["json"]
    assert again.finish_reason == "stop" and re.fullmatch(r"stalled=[0-9]{1,3};", again.text), again.text


def test_one_compile_per_spec(llm: LLM, gate: Gate) -> None:
    engine = llm.engine
    compiler = gate.compiler
    misses = compiler.stats.num_misses
    spec = _spec("shared")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured=spec)
    engine.add_request(EngineRequest("a", "x = ", params))
    engine.add_request(EngineRequest("b", "x = ", params))
    a, b = engine.scheduler.requests["a"], engine.scheduler.requests["b"]
    assert a.grammar is b.grammar is not None  # the second shares the first's compile
    gate.opened.set()
    tokens = _run(engine)
    assert len(gate.threads) == 1
    assert tokens["a"] == tokens["b"]
    engine.add_request(EngineRequest("c", "x = ", params))  # compiled: nothing to wait for
    assert engine.scheduler.requests["c"].status == RequestStatus.WAITING
    assert _run(engine)["c"] == tokens["a"]
    assert len(gate.threads) == 1


def test_a_failed_compile_ends_its_request_alone(llm: LLM, gate: Gate) -> None:
    engine = llm.engine
    gate.fail = True
    gate.opened.set()
    engine.add_request(EngineRequest("plain", "def g(y):", PLAIN))
    engine.add_request(EngineRequest("doomed", "x = ", SamplingParams(max_tokens=30, structured=_spec("doomed"))))
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["doomed"].finish_reason == "abort" and outs["doomed"].token_ids == []
    assert outs["plain"].finish_reason == "length" and len(outs["plain"].token_ids) == PLAIN.max_tokens
