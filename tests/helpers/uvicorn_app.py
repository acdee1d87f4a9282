"""An ASGI app served by uvicorn on a free loopback port, in a thread's event loop:
the HTTP front door as a client meets it, in the test's own process."""

import asyncio
import socket
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import uvicorn


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    done: Future

    def stop(self) -> None:
        self.server.should_exit = True
        self.done.result(10)


def serve(loop: asyncio.AbstractEventLoop, app: Any) -> Served:
    """Start `app` on `loop` (running in another thread); returns once uvicorn listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and not done.done(), "uvicorn did not start"
        time.sleep(0.01)
    return Served(f"http://127.0.0.1:{sock.getsockname()[1]}", server, done)
