"""The engine for asyncio services: LLMEngine stepped on a thread of its own.

The step loop never awaits the network. The asyncio side sends commands
through a thread-safe queue (add, abort, call); the thread applies them
between steps and hands each RequestOutput back to the event loop with
call_soon_threadsafe, into the asyncio.Queue of its request.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from shared.engine.engine_request import EngineRequest
from shared.engine.images import EncodedImages
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import EngineLoad, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDead(RuntimeError):
    """The engine thread stopped (a crash or shutdown): in-flight requests fail."""


@dataclass(slots=True)
class _Add:
    request: EngineRequest
    sink: asyncio.Queue
    future: asyncio.Future
    encoded: EncodedImages | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass(slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
        on_crash: Callable[[BaseException], None] | None = None,
    ) -> None:  # fmt: skip
        """on_crash(error): called on the event loop when the step loop dies of an error
        (a rank of the instance died, a bug), after the requests in flight were failed."""
        self.engine = engine
        self._on_crash = on_crash
        self._loop = loop
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._stopped = threading.Event()
        self._intake = threading.Lock()
        """Held while a command that waits for an answer is queued, and while the loop,
        stopping, fails what is queued: no such command is left unanswered."""
        self._error: BaseException | None = None
        self.last_load: EngineLoad = engine.load()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def shutdown(self) -> None:
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    # -- asyncio side --------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes. Leaving the iteration early
        (the caller was cancelled or broke out) aborts the request."""
        if self._stopped.is_set():
            raise EngineDead("the engine is stopped")
        # The vision tower runs on a worker thread, beside the step loop rather than in it:
        # a step waits for no image. Its refusals (InvalidParam) reach the caller from here.
        encoded = await asyncio.to_thread(self.engine.encode_images, request) if request.images is not None else None
        sink: asyncio.Queue = asyncio.Queue()
        added = self._loop.create_future()
        self._put(_Add(request, sink, added, encoded))
        await added  # raises the engine's ValueError for a bad request
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise EngineDead("the engine stopped") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between two steps."""
        future = self._loop.create_future()
        self._put(_Call(fn, future))
        return await future

    def _put(self, command: _Add | _Call) -> None:
        with self._intake:
            if self._stopped.is_set():
                raise EngineDead("the engine is stopped")
            self._commands.put(command)

    # -- engine thread -------------------------------------------------------

    def _resolve(self, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def apply() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._loop.call_soon_threadsafe(apply)

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
            self._sinks.pop(cmd.request_id, None)
        elif isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request, cmd.encoded)
            except ValueError as exc:
                self._resolve(cmd.future, error=exc)
                return
            self._sinks[cmd.request.request_id] = cmd.sink
            self._resolve(cmd.future)
        else:
            try:
                self._resolve(cmd.future, cmd.fn(self.engine))
            except Exception as exc:  # the caller gets the error; the loop goes on
                self._resolve(cmd.future, error=exc)

    def _run(self) -> None:
        commands: list[_Command] = []
        """Taken off the queue and not yet applied (the one being applied included)."""
        try:
            while True:
                commands = []
                if not self.engine.has_unfinished_requests():
                    try:  # idle: sleep until a command comes
                        commands.append(self._commands.get(timeout=0.5))
                    except queue.Empty:
                        self.engine.check_ranks()  # a rank that died while idle ends the loop now
                        continue
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                while commands:
                    cmd = commands[0]
                    if isinstance(cmd, _Stop):
                        return
                    self._apply(cmd)
                    commands.pop(0)
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        sink = self._sinks.get(out.request_id)
                        if sink is not None:
                            self._loop.call_soon_threadsafe(sink.put_nowait, out)
                            if out.finished:
                                del self._sinks[out.request_id]
                self.last_load = self.engine.load()
        except BaseException as exc:
            log.exception("engine step loop crashed")
            self._error = exc
        finally:
            reason = self._error or EngineDead("the engine was shut down")
            with self._intake:
                self._stopped.set()
                # Requests and calls queued but never applied (the balancer may have sent one
                # after the engine died) fail too: their callers would otherwise wait forever.
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
            for cmd in commands:
                if isinstance(cmd, (_Add, _Call)):
                    self._resolve(cmd.future, error=EngineDead(f"the engine stopped: {reason}"))
            # Whatever is still in flight fails loudly rather than waiting forever.
            for sink in self._sinks.values():
                self._loop.call_soon_threadsafe(sink.put_nowait, reason)
            self._sinks.clear()
            if self._error is not None and self._on_crash is not None:
                self._loop.call_soon_threadsafe(self._on_crash, self._error)
