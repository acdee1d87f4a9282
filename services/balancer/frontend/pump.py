"""Running a request's generation apart from its response: Pump runs a producer in
a task of its own (so the generator is iterated in one task and one context, and
cancelling that task cancels the request), and merge_deltas interleaves the
deltas of a request's jobs (prompts × samples) as they come."""

import asyncio
import contextvars
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, suppress
from typing import Generic, TypeVar

from services.balancer.frontend.choices import Delta, Job

T = TypeVar("T")


class Pump(Generic[T]):
    """Runs a producer in a task of its own, into a queue; close() cancels it."""

    def __init__(self, producer: AsyncGenerator[T, None], context: contextvars.Context) -> None:
        self._queue: asyncio.Queue[T | BaseException | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(producer), context=context)

    async def _run(self, producer: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(producer):  # a cancel lands in the producer and closes the generator
                async for item in producer:
                    self._queue.put_nowait(item)
        except Exception as exc:
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(None)

    async def next(self) -> T | None:
        """The next item, None at the end; raises what the producer raised."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task


async def merge_deltas(
    jobs: list[Job], deltas_of: Callable[[Job], AsyncGenerator[Delta, None]]
) -> AsyncGenerator[tuple[Job, Delta], None]:
    """Every job's deltas as they come, each tagged with its job. One job is iterated
    in place; several run in tasks of their own (in this context: their spans nest
    under the request's). The first failure ends all; closing this cancels them all."""
    if len(jobs) == 1:
        async with aclosing(deltas_of(jobs[0])) as deltas:
            async for delta in deltas:
                yield jobs[0], delta
        return
    queue: asyncio.Queue[tuple[Job, Delta] | BaseException | None] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async with aclosing(deltas_of(job)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((job, delta))
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task
