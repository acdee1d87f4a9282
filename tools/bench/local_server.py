"""The OpenAI API over one in-process engine, in a child process: bench-mesh's
`http` target, which separates the cost of HTTP/SSE and detokenization from the
cost of the mesh."""

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shared.engine.config import EngineConfig
from tools.launch.up import free_port, http_ok


class LocalServer:
    """The OpenAI API over an in-process engine, in a child process of its own (so
    its engine thread and event loop do not share a GIL with the benchmark's client)."""

    def __init__(self, config: EngineConfig, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        spec = json.dumps({"port": self.port, "engine": asdict(config)})
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.bench.local_server", spec],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not http_ok(f"http://127.0.0.1:{self.port}/health"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the local API server exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the local API server is not up after {timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # uvicorn exits on SIGTERM, then the engine thread stops
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve_local(spec: dict[str, Any]) -> None:
    """The child process of LocalServer."""
    import uvicorn

    from services.balancer.frontend.api import create_app
    from services.balancer.local import LocalGenerator
    from shared.recipe import Recipe
    from shared.runtime.settings import BalancerSettings

    async def serve() -> None:
        config = EngineConfig(**spec["engine"])
        generator = LocalGenerator.start(config)
        app = create_app(
            generator=generator,
            recipe=Recipe.from_pretrained(config.model),
            model_name=Path(config.model).name,
            max_model_len=generator.max_model_len,
            settings=BalancerSettings(),
        )
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=spec["port"], log_level="warning", lifespan="off")
        )
        try:
            await server.serve()
        finally:
            await generator.shutdown()

    asyncio.run(serve())


if __name__ == "__main__":  # the local API server's child process (LocalServer)
    _serve_local(json.loads(sys.argv[1]))
