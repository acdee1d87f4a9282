"""The balancer's queue: at most `limit` generation requests dispatched at once,
the others waiting in priority order (lower first, then arrival), as vLLM's
priority scheduling orders its waiting queue. A limit of 0 dispatches at once."""

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PriorityGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_active = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, f in self._waiting if not f.done())

    @asynccontextmanager
    async def place(self, priority: int) -> AsyncIterator[None]:
        """Hold one of the places for the body's duration, waiting in order for it."""
        if not self.enabled:
            yield
            return
        if self.num_active < self.limit and not self.num_waiting:
            self.num_active += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._arrivals), turn))
            try:
                await turn  # _leave hands its place over: num_active already counts us
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._leave()  # handed a place just as we were cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self.num_active -= 1
