"""A worker's HTTP /ready and /health, on the port that serves /metrics (issue 11):
what HTTP-only probes (Kubernetes' httpGet, compose's health checks) ask.

A real decode stage in this process (its setup, as `python -m services.decode`
runs it), a real nats-server and HTTP on a real socket: /ready is 503 while the
engine loads, 200 once the instance is loaded, registered and subscribed, 503
again while it drains; /health stays 200 throughout; /metrics is unchanged."""

import asyncio
import json
import urllib.error
import urllib.request
from contextlib import AsyncExitStack

import pytest
from opentelemetry import trace

from services.decode.service import DecodeService
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus
from shared.runtime.metrics import Metrics
from shared.runtime.service import ServiceContext
from shared.runtime.settings import load_settings
from shared.stage.worker import Dispatch, Worker, serve_engine_stage
from tests.helpers.mesh_procs import NatsServer
from tools.launch.up import free_port


def get(port: int, path: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            status, body = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read().decode()
    return status, (json.loads(body) if path != "/metrics" else body)


async def aget(port: int, path: str) -> tuple[int, dict | str]:
    return await asyncio.to_thread(get, port, path)  # the server answers from its thread; the loop keeps running


@pytest.fixture
def nats_url(tmp_path):
    server = NatsServer(tmp_path / "nats")
    yield server.url
    server.stop()


@pytest.mark.asyncio
async def test_ready_is_503_while_loading_200_when_serving_and_503_while_draining(nats_url, mesh_model_dir):
    settings = load_settings(env={
        "INFERMESH_NATS__URL": nats_url,
        "INFERMESH_ENGINE__MODEL": mesh_model_dir,
        "INFERMESH_KVCACHE__ADDRESS": f"127.0.0.1:{free_port()}",  # none: a soft dependency
        "INFERMESH_WORKER__DRAIN_TIMEOUT_S": "30",
    })
    bus = await Bus.connect(settings.nats, name="decode-0")
    metrics = Metrics("decode")
    port = metrics.serve(0, host="127.0.0.1")
    stop = asyncio.Event()
    ctx = ServiceContext("decode", "decode-0", settings, bus, trace.get_tracer("test"), metrics, stop)
    workers: list[Worker] = []

    def dispatch(worker: Worker) -> list[Dispatch]:
        workers.append(worker)
        return [Dispatch(subjects.decode_admit("decode-0"), mesh_pb2.DecodeHandoff, DecodeService(ctx, worker).on_admit)]

    try:
        # As run_service orders it: /metrics (and /ready) are up before the engine loads.
        assert await aget(port, "/ready") == (503, {"ready": False, "reason": "starting"})
        assert await aget(port, "/health") == (200, {"status": "alive"})
        heartbeats: asyncio.Queue[str] = asyncio.Queue()

        async def on_heartbeat(msg) -> None:  # noqa: ANN001
            heartbeats.put_nowait(msg.subject)

        await bus.nc.subscribe(subjects.heartbeat("decode", "decode-0"), cb=on_heartbeat)
        async with AsyncExitStack() as stack:
            loading = asyncio.create_task(serve_engine_stage(ctx, stack, dispatch))
            num_loading_503 = 0
            while not loading.done():  # the whole load long: never ready before the engine is there
                engine_loaded = bool(workers)
                status, body = await aget(port, "/ready")
                if status == 200:
                    assert workers, "ready before the engine was loaded"
                elif body["reason"] != "starting":  # loaded, then registering: never ready before both
                    assert workers and body["reason"] == "not registered on the bus yet", body
                else:
                    num_loading_503 += not engine_loaded
                await asyncio.sleep(0.02)
            await loading
            assert num_loading_503 >= 1
            assert await aget(port, "/ready") == (200, {"ready": True})
            await asyncio.wait_for(heartbeats.get(), 5)  # ready meant registered: its heartbeat is on the bus
            status, text = await aget(port, "/metrics")
            assert status == 200 and "infermesh_decode_running_requests" in text
            # Drain with a request in flight: not ready for the whole drain, alive throughout.
            (worker,) = workers
            in_flight = worker.spawn("r-1", asyncio.sleep(60))
            closing = asyncio.create_task(stack.aclose())
            deadline = asyncio.get_running_loop().time() + 10
            while (await aget(port, "/ready"))[0] == 200:
                assert asyncio.get_running_loop().time() < deadline, "still ready after the drain began"
                await asyncio.sleep(0.02)
            for _ in range(5):
                assert await aget(port, "/ready") == (503, {"ready": False, "reason": "draining"})
                assert await aget(port, "/health") == (200, {"status": "alive"})
                await asyncio.sleep(0.05)
            assert not closing.done()  # the drain waits for the request
            in_flight.cancel()
            await asyncio.wait_for(closing, 30)
    finally:
        metrics.close()
        await bus.close()
