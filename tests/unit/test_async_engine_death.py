"""When the engine's step loop dies (a rank of the instance died: WorkerFailed from the
idle check or a step), nothing waits forever: a request queued before the loop saw it
fails with EngineDead, so do requests and calls that come later, and the owner hears of
the crash (the stage worker then stops the instance, shared/stage/worker.py). The
engine here is a stand-in whose ranks die: the loop's own code is what runs."""

import asyncio

import pytest

from shared.engine.async_engine import AsyncEngine, EngineDead
from shared.engine.engine_request import EngineRequest
from shared.engine.executor.multiproc import WorkerFailed
from shared.engine.outputs import EngineLoad
from shared.engine.sampling_params import SamplingParams


class DyingEngine:
    """Idle, until check_ranks reports a dead rank; requests are taken and never stepped."""

    def __init__(self) -> None:
        self.dead = asyncio.Event()
        self.rank_died = False

    def has_unfinished_requests(self) -> bool:
        return False

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0, 0, 0)

    def check_ranks(self) -> None:
        if self.rank_died:
            raise WorkerFailed("tensor-parallel worker rank 1 died; exit code -9")

    def add_request(self, request: EngineRequest, encoded: object = None) -> None:
        raise WorkerFailed("tensor-parallel worker rank 1 could not be sent a step")


def test_a_dead_rank_fails_what_waits_and_tells_the_owner() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        crashed: list[BaseException] = []
        engine = DyingEngine()
        async_engine = AsyncEngine(engine, loop, on_crash=crashed.append)  # type: ignore[arg-type]
        async_engine.start()
        request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4))
        # The request is taken while a rank is already gone: adding it kills the loop.
        with pytest.raises(EngineDead, match="could not be sent a step"):
            async for _ in async_engine.generate(request):
                pass
        for _ in range(100):
            if crashed:
                break
            await asyncio.sleep(0.01)
        assert len(crashed) == 1 and isinstance(crashed[0], WorkerFailed)
        with pytest.raises(EngineDead):  # later work is refused at once
            await async_engine.call(lambda e: None)
        await asyncio.wait_for(async_engine.shutdown(), 5)

    asyncio.run(go())


def test_a_rank_that_dies_while_idle_ends_the_loop_within_a_second() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        crashed: list[BaseException] = []
        engine = DyingEngine()
        async_engine = AsyncEngine(engine, loop, on_crash=crashed.append)  # type: ignore[arg-type]
        async_engine.start()
        await asyncio.sleep(0.1)
        engine.rank_died = True
        for _ in range(150):
            if crashed:
                break
            await asyncio.sleep(0.01)
        assert len(crashed) == 1 and "rank 1 died" in str(crashed[0])
        with pytest.raises(EngineDead):
            async for _ in async_engine.generate(EngineRequest("r", [1], SamplingParams(max_tokens=1))):
                pass

    asyncio.run(go())
