"""`infermesh up`: nats-server plus one process per service instance on this
machine, each started exactly as docker-compose or Helm would start it
(`python -m services.<stage>` with INFERMESH_* variables), health-checked
before the API address is printed. Ctrl-C (or SIGTERM) stops them all,
services first (they drain), NATS last."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_nats_server() -> str:
    for candidate in (shutil.which("nats-server"), "/usr/sbin/nats-server", "/usr/bin/nats-server"):
        if candidate and os.path.exists(candidate):
            return candidate
    raise FileNotFoundError("nats-server is not installed: apt-get install nats-server (make run does it)")


def grpc_serving(address: str, timeout_s: float = 1.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass
class Mesh:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    port: int = 8000
    state_dir: Path = Path(".infermesh")
    host: str = "127.0.0.1"
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    nats_url: str = ""
    kv_address: str = ""
    _commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict, init=False, repr=False)

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def trace_dir(self) -> Path:
        return self.state_dir / "traces"

    def _env(self, **more: str) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "INFERMESH_NATS__URL": self.nats_url,
            "INFERMESH_ENGINE__MODEL": self.model,
            "INFERMESH_KVCACHE__ADDRESS": self.kv_address,
            "INFERMESH_KVCACHE__PATH": str(self.state_dir / "kvcache"),
            "INFERMESH_TELEMETRY__TRACE_DIR": str(self.trace_dir),
            "INFERMESH_BALANCER__HOST": self.host,
            "INFERMESH_BALANCER__PORT": str(self.port),
            **self.extra_env,
        }
        env.update(more)
        return env

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        self._commands[name] = (args, env)
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start the stopped process `name` again as it was started (same command,
        environment and ports); it takes its old place in procs. Returns at once:
        the caller waits for its health."""
        i = next(i for i, (n, _) in enumerate(self.procs) if n == name)
        if self.procs[i][1].poll() is None:
            raise RuntimeError(f"{name} is still running")
        proc = self._start(name, *self._commands[name])
        self.procs[i] = self.procs.pop()
        return proc

    def _wait(self, what: str, check, timeout_s: float) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    log = self.state_dir / "logs" / f"{name}.log"
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}")
            if check():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{what} not healthy after {timeout_s:.0f}s; logs in {self.state_dir / 'logs'}")

    def start(self, timeout_s: float = 120.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        nats_port = free_port()
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self._start(
            "nats",
            [find_nats_server(), "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(self.state_dir / "nats")],
            dict(os.environ),
        )
        self._wait("nats-server", lambda: _port_open(nats_port), 10)
        self.kv_address = f"127.0.0.1:{free_port()}"
        py = [sys.executable, "-m"]
        self._start("kvcache", py + ["services.kvcache"], self._env())
        self._wait("kvcache", lambda: grpc_serving(self.kv_address), timeout_s)
        health: list[str] = []
        for stage, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for i in range(count):
                grpc_port = free_port()
                env = self._env(INFERMESH_WORKER__INSTANCE_ID=f"{stage}-{i}", INFERMESH_WORKER__GRPC_PORT=str(grpc_port))
                self._start(f"{stage}-{i}", py + [f"services.{stage}"], env)
                health.append(f"127.0.0.1:{grpc_port}")
        self._start("balancer", py + ["services.balancer"], self._env())
        self._wait("prefill and decode", lambda: all(grpc_serving(a) for a in health), timeout_s)
        self._wait("balancer", lambda: http_ok(f"http://{self.host}:{self.port}/ready"), timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM services (they drain), then NATS; SIGKILL what lingers."""
        services = [(n, p) for n, p in self.procs if n != "nats"]
        nats_procs = [(n, p) for n, p in self.procs if n == "nats"]
        for group in (services, nats_procs):
            for _, proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for _, proc in group:
                try:
                    proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def run_demo(mesh: Mesh) -> None:
    """Stream one chat completion with the official openai client, then show its trace."""
    import openai

    from tools.launch.trace_view import load_spans, pick_trace, render_waterfall

    client = openai.OpenAI(base_url=mesh.api_url, api_key="not-needed")
    model = client.models.list().data[0].id
    print(f"model: {model}\n> Write a haiku about paged attention.\n", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about paged attention."}],
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    print(f"\n\nusage: {usage}\n")
    time.sleep(1.0)  # the services export spans in batches every 200 ms
    print(render_waterfall(pick_trace(load_spans(mesh.trace_dir), "last")))


def up(model: str, num_prefill: int, num_decode: int, port: int, state_dir: str, demo: bool) -> int:
    mesh = Mesh(model, num_prefill, num_decode, port, Path(state_dir))
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        print(f"starting the mesh: {num_prefill} prefill, {num_decode} decode, model {model}", file=sys.stderr)
        mesh.start()
        print(f"InferMesh is up: OpenAI API at {mesh.api_url}  (logs and traces in {state_dir})", flush=True)
        if demo:
            run_demo(mesh)
            return 0
        print("Ctrl-C stops it.", file=sys.stderr)
        while True:
            time.sleep(1)
            for name, proc in mesh.procs:
                if proc.poll() is not None:
                    print(f"{name} exited with {proc.returncode}; stopping the mesh", file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping the mesh ...", file=sys.stderr)
        mesh.stop()
