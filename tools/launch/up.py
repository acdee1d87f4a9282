"""`infermesh up`: nats-server plus one process per service instance on this
machine, each started exactly as docker-compose or Helm would start it
(`python -m services.<stage>` with INFERMESH_* variables), health-checked
before the API address is printed. Ctrl-C (or SIGTERM) stops them all:
the balancer and the workers first (they drain, and flush the KV they write
behind to kvcache), then kvcache (it commits its LMDB), NATS last.

Closed by default: the mesh's NATS takes only the users `up` writes into
<state_dir>/nats-auth.conf (mode 0600), one per instance with random
passwords and the subject permissions of tools/launch/nats_auth.py (the file
also raises max_payload to the mesh's, as compose's and Helm's do); each gRPC
client (prefill, decode, vision, the balancer) carries a token of its own made
here, which every gRPC server knows by its hash (worker.grpc_peers; kvcache lets
only prefill and decode store blocks); every service binds loopback. gRPC runs
without TLS here (every process on one host, on loopback): mutual TLS is
Helm's, or given through the worker.tls_* settings (extra_env), which the
health checks here then use too.

Placed: by default every process runs here and binds loopback; a Placement
per process name (nats, kvcache, prefill-0, ..., balancer) gives it another
address to bind and be reached at, and a command to run under (a network
namespace of its own, as the multi-host tests do; a container runtime).

Supervised: a process that dies is started again (same command, environment
and ports) after a backoff that doubles from 0.5 s to 10 s (back to 0.5 s once
it has run for 30 s); the others keep serving.

Scaled: the supervisor also keeps each worker stage at the count that
<state_dir>/replicas.json asks for (shared/runtime/desired_replicas.py; the live
planner writes it): an instance added gets a NATS user of its own (nats-server
made at start) and joins the registry by its heartbeats; one removed, the
highest-numbered, is sent SIGTERM and drains (its requests finish or move).
Every instance number the supervisor may use gets its NATS user at start (as
Helm's `maxInstances` does), so scaling never reloads nats-server: a reload
drops the one-time reply grants of requests in flight, and their acks would be
refused. Every child is started through
a tiny exec wrapper that asks the kernel to kill it when `up` dies
(PR_SET_PDEATHSIG), so even `kill -9` of `up` leaves no orphan."""

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.runtime.desired_replicas import FILE_NAME as REPLICAS_FILE
from shared.runtime.desired_replicas import read_desired
from shared.runtime.rpc import TlsFiles
from shared.runtime.rpc_auth import peers_setting
from shared.runtime.settings import load_settings
from tools.launch.nats_auth import MAX_PAYLOAD, MeshCredentials, grpc_tokens, server_limits

# Run by the child before it execs its command: die with the thread that
# started it (prctl(PR_SET_PDEATHSIG, SIGKILL)), and give up if that parent is
# already gone. A wrapper rather than preexec_fn, which is unsafe in a process
# with threads (the supervisor is one). Without prctl (not Linux) the child
# runs anyway, and says that it may outlive `up`.
_PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "prctl = getattr(ctypes.CDLL(None, use_errno=True), 'prctl', None)\n"
    "if prctl is None: print('no prctl here: this process may outlive infermesh up', file=sys.stderr)\n"
    "elif prctl(1, signal.SIGKILL) != 0: sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)
UNSHARE_PID = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
"""A command's prefix that runs it in a PID namespace of its own (and dies with it)."""
RESTART_BACKOFF_S = (0.5, 10.0)  # first delay, longest delay
RESTART_RESET_AFTER_S = 30.0  # a process that ran this long restarts after the first delay again
LOG_TAIL_LINES = 12  # what a start failure shows of the failed process's log


class StartFailed(RuntimeError):
    """A process died, or did not come up in time, while the mesh started. The
    message's first line says which and why (its log's last line); the last lines
    of its log follow."""


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last non-empty lines of a log (progress bars' carriage returns cut to their last state)."""
    try:
        text = path.read_bytes()[-(64 << 10) :].decode(errors="replace")
    except OSError:
        return []
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
    return [line for line in lines if line.strip()][-num_lines:]


FIRST_PICKED_PORT = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ends of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback port below the ephemeral range: a port from inside it (what
    binding port 0 gives) can be taken by any outgoing connection's local end
    between this pick and the service's own bind, and the service then fails with
    'address already in use'."""
    low = ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(64 if low - FIRST_PICKED_PORT >= 1000 else 0):
        port = rng.randrange(FIRST_PICKED_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_nats_server() -> str:
    for candidate in (shutil.which("nats-server"), "/usr/sbin/nats-server", "/usr/bin/nats-server"):
        if candidate and os.path.exists(candidate):
            return candidate
    raise FileNotFoundError("nats-server is not installed: apt-get install nats-server (make run does it)")


def grpc_serving(address: str, timeout_s: float = 1.0, tls: TlsFiles | None = None) -> bool:
    """Whether the gRPC server at address says SERVING (over mutual TLS with tls)."""
    try:
        channel = grpc.secure_channel(address, tls.channel_credentials()) if tls else grpc.insecure_channel(address)
        with channel:
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


@dataclass(frozen=True)
class Placement:
    """Where one process of the mesh runs."""

    host: str = "127.0.0.1"
    """The address it binds (worker.bind_host; nats-server's listen address) and the
    others reach it at."""
    wrap: Callable[[list[str]], list[str]] | None = None
    """Turns its command into the one that runs it there (a network namespace, say);
    None runs it as it is."""


LOOPBACK = Placement()


@dataclass
class Mesh:
    """auth: NATS users and permissions, and the gRPC tokens (on for `up`; off only
    for a test that wants an open mesh). supervise: restart what dies (`up`
    turns it on; tests that kill instances want them to stay dead). Call start()
    and restart() from a thread that outlives the mesh (the main thread, say): a
    child dies with the thread that started it (PR_SET_PDEATHSIG)."""

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    port: int = 8000
    state_dir: Path = Path(".infermesh")
    host: str = "127.0.0.1"
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    nats_url: str = ""
    """NATS as the operator: with auth, the `admin` user's credentials (anything
    goes; the password is in the same 0600 file as every other one)."""
    kv_address: str = ""
    auth: bool = True
    supervise: bool = False
    grpc_tokens: dict[str, str] | None = None
    """The gRPC token of each identity (prefill, decode, vision, balancer; rpc_auth.IDENTITIES):
    made at start when auth is on and none are given. Every service's server takes them all
    (worker.grpc_peers), each client carries its stage's."""
    pid_namespaces: bool = False
    """Run kvcache, prefill and decode each in a PID namespace of its own (`unshare`),
    as containers run them: no process can map another's memory through /proc, so KV
    moves through NIXL or kvcache, never the same-namespace copy."""
    restarts: dict[str, int] = field(default_factory=dict)
    """How many times the supervisor restarted each process."""
    healthy: set[str] = field(default_factory=set)
    """The processes that have come up (passed their health check) since start."""
    on_wait: "Callable[[Mesh], None] | None" = None
    """Called while start() waits for the processes, every 0.1 s (up's progress bars)."""
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Each service's Prometheus /metrics port, by process name (kvcache, prefill-0, ..., balancer;
    the balancer also serves its series on the API port's /metrics)."""
    planner_profile: str = ""
    """A stage profile (`infermesh profile`): run the live planner (services/planner) on it,
    scaling the worker stages through the replicas file (needs supervise); "": no planner."""
    num_vision: int = 0
    """Vision instances (E/P/D: they encode requests' images for prefill and decode); 0
    leaves the encoding to prefill (E/PD)."""
    max_instances: int = 0
    """NATS users made at start for each worker stage, by instance number (never fewer than
    the stage starts with): the supervisor scales within them without reloading nats-server.
    0: the planner's max_replicas when supervised, else each stage's start count."""
    placements: dict[str, Placement] = field(default_factory=dict)
    """Where each process runs, by name (nats, kvcache, prefill-0, decode-0, ...,
    balancer); one not named runs here on loopback. The balancer's API listens on
    `host` wherever it runs."""
    nats_max_payload: int | None = MAX_PAYLOAD
    """nats-server's max_payload; None keeps its default 1 MiB (a test of long messages in parts)."""
    _commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict, init=False, repr=False)
    _creds: MeshCredentials | None = field(default=None, init=False, repr=False)
    _services_nats_url: str = field(default="", init=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _exit: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _supervisor: threading.Thread | None = field(default=None, init=False, repr=False)
    _started_at: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _tls: TlsFiles | None = field(default=None, init=False, repr=False)
    _nats_port: int = field(default=0, init=False, repr=False)
    _retiring: set[str] = field(default_factory=set, init=False, repr=False)
    """Instances scaled away: sent SIGTERM, draining; not restarted when they exit."""
    _desired_seen: float = field(default=-1.0, init=False, repr=False)
    """The replicas file's mtime last applied."""
    """Mutual TLS files the services were given (extra_env's worker.tls_*): what the health checks present."""

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def trace_dir(self) -> Path:
        return self.state_dir / "traces"

    @property
    def nats_config(self) -> Path:
        return self.state_dir / "nats-auth.conf"

    @property
    def replicas_file(self) -> Path:
        """Where a planner asks for each stage's count (see the module docstring)."""
        return self.state_dir / REPLICAS_FILE

    def instances(self, stage: str) -> list[str]:
        """The stage's instances running and not scaled away, by number."""
        with self._lock:
            names = [n for n, p in self.procs if _stage_of(n) == stage and n not in self._retiring]
        return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))

    def credentials(self, user: str) -> tuple[str, str]:
        """(user, password) of one of the mesh's NATS users: balancer, kvcache,
        monitor, or an instance (prefill-0, decode-1, ...)."""
        assert self._creds is not None, "the mesh runs without auth"
        return user, self._creds.users[user].password

    def _at(self, name: str) -> Placement:
        return self.placements.get(name, LOOPBACK)

    def _bind_env(self, name: str) -> dict[str, str]:
        """worker.bind_host for a placed process (extra_env decides for the others)."""
        return {"INFERMESH_WORKER__BIND_HOST": self._at(name).host} if name in self.placements else {}

    def _env(self, user: str, **more: str) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "INFERMESH_NATS__URL": self._services_nats_url,
            "INFERMESH_ENGINE__MODEL": self.model,
            "INFERMESH_KVCACHE__ADDRESS": self.kv_address,
            "INFERMESH_KVCACHE__PATH": str(self.state_dir / "kvcache"),
            "INFERMESH_TELEMETRY__TRACE_DIR": str(self.trace_dir),
            "INFERMESH_BALANCER__HOST": self.host,
            "INFERMESH_BALANCER__PORT": str(self.port),
        }
        if self._creds is not None:
            env["INFERMESH_NATS__USER"], env["INFERMESH_NATS__PASSWORD"] = self.credentials(user)
            tokens = self.grpc_tokens or {}
            env["INFERMESH_WORKER__GRPC_PEERS"] = peers_setting(tokens)
            if _stage_of(user) in tokens:  # kvcache calls nobody: no token of its own
                env["INFERMESH_WORKER__GRPC_TOKEN"] = tokens[_stage_of(user)]
        env.update(self.extra_env)
        env.update(more)
        return env

    def _metrics_env(self, name: str) -> dict[str, str]:
        """A /metrics port of its own for the process `name`, kept across restarts, so a scraper finds it."""
        port = self.metrics_ports.setdefault(name, free_port())
        return {"INFERMESH_WORKER__METRICS_PORT": str(port)}

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        wrap = self._at(name).wrap
        own_pid_namespace = self.pid_namespaces and name not in ("nats", "balancer")
        run = wrap(args) if wrap else ([*UNSHARE_PID, *args] if own_pid_namespace else args)
        wrapped = [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *run]
        with (logs / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(wrapped, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with self._lock:
            self.procs.append((name, proc))
            self._commands[name] = (args, env)
            self._started_at[name] = time.monotonic()
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start the stopped process `name` again as it was started (same command,
        environment and ports); it takes its old place in procs. Returns at once:
        the caller waits for its health."""
        with self._lock:
            i = next(i for i, (n, _) in enumerate(self.procs) if n == name)
            if self.procs[i][1].poll() is None:
                raise RuntimeError(f"{name} is still running")
            proc = self._start(name, *self._commands[name])
            self.procs[i] = self.procs.pop()
        return proc

    def _wait(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        """Until check() passes; StartFailed if a process dies first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise self._failure(name, f"exited with code {proc.returncode} while the mesh started")
            if self.on_wait is not None:
                self.on_wait(self)
            if check():
                if self.on_wait is not None:
                    self.on_wait(self)
                return
            time.sleep(0.1)
        late = [n for n, _ in self.procs if n not in self.healthy]
        raise self._failure(late[0] if late else what, f"is not healthy after {timeout_s:.0f} s (waiting for {what})")

    def _failure(self, name: str, what: str) -> StartFailed:
        log = self.state_dir / "logs" / f"{name}.log"
        tail = log_tail(log)
        cause = f": {tail[-1].strip()}" if tail else ""
        lines = [f"{name} {what}{cause}", f"last lines of {log}:", *(f"  | {line}" for line in tail)]
        return StartFailed("\n".join(lines))

    def _until_healthy(self, name: str, check: Callable[[], bool]) -> Callable[[], bool]:
        """check, noting `name` as healthy once it passes."""

        def checked() -> bool:
            if name in self.healthy:
                return True
            if check():
                self.healthy.add(name)
                return True
            return False

        return checked

    def _stages(self) -> tuple[tuple[str, int], ...]:
        """(stage, instances) of the worker stages, in start order."""
        return (("prefill", self.num_prefill), ("decode", self.num_decode), ("vision", self.num_vision))

    def _make_credentials(self, nats_port: int) -> None:
        """One NATS user per instance (its own subjects only), the balancer, kvcache,
        a read-only monitor and the operator's admin; random passwords; the config
        file nats-server reads."""
        creds = MeshCredentials()
        for role in ("balancer", "kvcache", "monitor", "admin"):
            creds.add(role, role)
        for stage, count in self._stages():
            for i in range(max(count, self._user_slots())):
                creds.add(f"{stage}-{i}", stage, instance=f"{stage}-{i}")
        creds.write_config(self.nats_config, self._at("nats").host, nats_port, self.nats_max_payload)
        self._creds = creds
        self.grpc_tokens = self.grpc_tokens or grpc_tokens()

    def _user_slots(self) -> int:
        """Instance numbers per worker stage that get a NATS user at start (see max_instances)."""
        if self.max_instances:
            return self.max_instances
        return load_settings(env={**os.environ, **self.extra_env}).planner.max_replicas if self.supervise else 0

    def start(self, timeout_s: float = 120.0) -> None:
        self.start_store(timeout_s)
        self._start_workers_and_balancer(timeout_s)

    def start_store(self, timeout_s: float = 120.0) -> None:
        """nats-server and kvcache alone (what a benchmark of the KV tiers needs); start() runs it first."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._tls = TlsFiles.load(load_settings(env=self.extra_env).worker)
        nats_port = free_port()
        nats_host = self._at("nats").host
        self._services_nats_url = self.nats_url = f"nats://{nats_host}:{nats_port}"
        self._nats_port = nats_port
        nats_args = [find_nats_server()]
        if self.auth:
            self._make_credentials(nats_port)
            user, password = self.credentials("admin")
            self.nats_url = f"nats://{user}:{password}@{nats_host}:{nats_port}"
        else:  # an open mesh still takes the mesh's message size
            self.nats_config.write_text(server_limits(self.nats_max_payload))
        nats_args += ["-c", str(self.nats_config)]
        nats_args += ["-a", nats_host, "-p", str(nats_port), "-js", "-sd", str(self.state_dir / "nats")]
        self._start("nats", nats_args, dict(os.environ))
        self._wait("nats-server", self._until_healthy("nats", lambda: _port_open(nats_host, nats_port)), 10)
        self.kv_address = f"{self._at('kvcache').host}:{free_port()}"
        py = [sys.executable, "-m"]
        self._start("kvcache", py + ["services.kvcache"],
                    self._env("kvcache", **self._metrics_env("kvcache"), **self._bind_env("kvcache")))
        self._wait("kvcache", self._until_healthy("kvcache", lambda: grpc_serving(self.kv_address, tls=self._tls)),
                   timeout_s)

    def _start_instance(self, stage: str, i: int) -> Callable[[], bool]:
        """Start instance i of a worker stage; returns its health check."""
        grpc_port = free_port()
        name = f"{stage}-{i}"
        env = self._env(name, INFERMESH_WORKER__INSTANCE_ID=name, INFERMESH_WORKER__GRPC_PORT=str(grpc_port),
                        **self._metrics_env(name), **self._bind_env(name))
        self._start(name, [sys.executable, "-m", f"services.{stage}"], env)
        address = f"{self._at(name).host}:{grpc_port}"
        return self._until_healthy(name, lambda: grpc_serving(address, tls=self._tls))

    def _start_workers_and_balancer(self, timeout_s: float) -> None:
        py = [sys.executable, "-m"]
        health = [self._start_instance(stage, i) for stage, count in self._stages() for i in range(count)]
        self._start("balancer", py + ["services.balancer"],
                    self._env("balancer", **self._metrics_env("balancer"), **self._bind_env("balancer")))
        # Every worker checked at each round (not all(), which stops at the first still loading).
        self._wait("prefill, decode and vision" if self.num_vision else "prefill and decode", lambda: sum(check() for check in health) == len(health), timeout_s)
        ready = f"http://{self.host}:{self.port}/ready"
        self._wait("balancer", self._until_healthy("balancer", lambda: http_ok(ready)), timeout_s)
        if self.planner_profile:
            self._start_planner()
        if self.supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="mesh-supervisor", daemon=True)
            self._supervisor.start()

    def _start_planner(self) -> None:
        """The live planner, deciding through this supervisor's replicas file. It logs in
        to no NATS (it reads the balancer's /metrics): no user is made for it."""
        if not self.supervise:
            raise StartFailed("the planner scales through the supervisor: start the mesh with supervise on")
        env = {**self._env("monitor"), **self._metrics_env("planner"),
               "INFERMESH_PLANNER__PROFILE": str(Path(self.planner_profile).resolve()),
               "INFERMESH_PLANNER__BACKEND": "up",
               "INFERMESH_PLANNER__REPLICAS_FILE": str(self.replicas_file.resolve()),
               "INFERMESH_PLANNER__METRICS_URL": f"http://{self.host}:{self.port}/metrics"}
        for key in ("INFERMESH_NATS__USER", "INFERMESH_NATS__PASSWORD", "INFERMESH_WORKER__GRPC_TOKEN",
                    "INFERMESH_WORKER__GRPC_PEERS"):
            env.pop(key, None)  # it needs none of the mesh's credentials
        env.update({k: v for k, v in self.extra_env.items() if k.startswith("INFERMESH_PLANNER__")})
        self._start("planner", [sys.executable, "-m", "services.planner"], env)

    def _supervise(self) -> None:
        """Restart what dies, with backoff. The thread lives until stop() is done:
        children it started die with it (PR_SET_PDEATHSIG follows the thread)."""
        delays: dict[str, float] = {}
        due: dict[str, float] = {}
        while not self._stopping.wait(0.2):
            self._apply_desired()
            with self._lock:
                dead = [(n, p) for n, p in self.procs if p.poll() is not None]
            now = time.monotonic()
            for name, proc in dead:
                if name in self._retiring:
                    self._retired(name, proc)
                    continue
                if name not in due:
                    ran_s = now - self._started_at.get(name, now)
                    delay = RESTART_BACKOFF_S[0] if ran_s >= RESTART_RESET_AFTER_S else delays.get(name, RESTART_BACKOFF_S[0])
                    delays[name] = min(delay * 2, RESTART_BACKOFF_S[1])
                    due[name] = now + delay
                    print(f"{name} exited with {proc.returncode} after {ran_s:.1f}s; restarting it in {delay:.1f}s",
                          file=sys.stderr, flush=True)
                elif now >= due[name] and not self._stopping.is_set():
                    del due[name]
                    try:
                        self.restart(name)
                    except Exception as exc:  # noqa: BLE001  (the supervisor must outlive one bad start)
                        print(f"restarting {name} failed: {exc}", file=sys.stderr, flush=True)
                        continue
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    print(f"{name} restarted (restart {self.restarts[name]})", file=sys.stderr, flush=True)
        self._exit.wait()

    def _apply_desired(self) -> None:
        """Bring each stage to the replicas file's count (on the supervisor's thread:
        children die with the thread that started them)."""
        try:
            mtime = self.replicas_file.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._desired_seen:
            return
        self._desired_seen = mtime
        try:
            desired = read_desired(self.replicas_file)
        except ValueError as exc:
            print(f"ignoring the replicas file: {exc}", file=sys.stderr, flush=True)
            return
        if desired.get("decode", 1) < 1:
            print("ignoring the replicas file: the mesh needs a decode instance", file=sys.stderr, flush=True)
            return
        for stage, want in desired.items():
            have = self.instances(stage)
            if want > len(have):
                taken = {int(n.rsplit("-", 1)[1]) for n, _ in self.procs if _stage_of(n) == stage}
                free = (i for i in range(want + len(taken)) if i not in taken)
                added = [f"{stage}-{next(free)}" for _ in range(want - len(have))]
                self._grant(added, stage)
                for name in added:
                    self._start_instance(stage, int(name.rsplit("-", 1)[1]))
                print(f"scaled {stage} up to {want}: started {', '.join(added)}", file=sys.stderr, flush=True)
            for name in reversed(have[want:]):  # the highest numbers drain and go
                with self._lock:
                    self._retiring.add(name)
                    proc = dict(self.procs)[name]
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                print(f"scaling {stage} down to {want}: {name} drains and stops", file=sys.stderr, flush=True)
            setattr(self, f"num_{stage}", want)

    def _grant(self, names: list[str], stage: str) -> None:
        """NATS users for new instances, in force before they connect: made at start for
        numbers below max_instances; one beyond them is added with a reload (said in the log)."""
        missing = [n for n in names if self._creds is not None and n not in self._creds.users]
        if not missing:
            return
        assert self._creds is not None
        for name in missing:
            self._creds.add(name, stage, instance=name)
        print(f"no NATS user was made at start for {', '.join(missing)} (max_instances): adding them reloads "
              "nats-server, which may cost requests in flight a retry", file=sys.stderr, flush=True)
        self._reload_nats()

    def _retired(self, name: str, proc: subprocess.Popen) -> None:
        """A scaled-away instance has exited: forget it. Its NATS user stays for the next
        instance of that number (removing it would reload nats-server)."""
        with self._lock:
            self.procs = [(n, p) for n, p in self.procs if p is not proc]
            self._retiring.discard(name)
        print(f"{name} stopped (scaled down; exit code {proc.returncode})", file=sys.stderr, flush=True)

    def _reload_nats(self) -> None:
        """Rewrite the users and have nats-server read them (SIGHUP reloads its config)."""
        assert self._creds is not None
        self._creds.write_config(self.nats_config, self._at("nats").host, self._nats_port, self.nats_max_payload)
        nats = dict(self.procs).get("nats")
        if nats is not None and nats.poll() is None:
            nats.send_signal(signal.SIGHUP)
            time.sleep(0.5)  # the reload is asynchronous; a new user's first connect must find it

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the balancer and the workers (they drain, then flush what they write
        behind to kvcache), then kvcache, then NATS, each group once the one before
        has exited: kvcache stopped beside the workers would refuse their last stores.
        SIGKILL what lingers past timeout_s in its group (None: the workers' drain and
        flush bounds, worker.drain_timeout_s + worker.kv_flush_timeout_s, plus 15 s for
        the engine's stop)."""
        self._stopping.set()  # no restarts from here on
        if timeout_s is None:
            try:
                worker = load_settings(env={**os.environ, **self.extra_env}).worker
                timeout_s = worker.drain_timeout_s + worker.kv_flush_timeout_s + 15.0
            except ValueError:  # settings a start refused: nothing drains long
                timeout_s = 15.0
        with self._lock:
            last = ("kvcache", "nats")
            services = [(n, p) for n, p in self.procs if n not in last]
            stores = [(n, p) for n, p in self.procs if n == "kvcache"]
            nats_procs = [(n, p) for n, p in self.procs if n == "nats"]
        for group in (services, stores, nats_procs):
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
        self._exit.set()
        if self._supervisor is not None:
            self._supervisor.join()
        with self._lock:
            self.procs.clear()


def parallel_env(
    tensor_parallel_size: int | None, enable_expert_parallel: bool | None,
    enable_eplb: bool | None = None, eplb_config: str | None = None, data_parallel_size: int | None = None,
) -> dict[str, str]:  # fmt: skip
    """The INFERMESH_ENGINE__ variables that give every engine instance the flags' split
    and its EPLB (a flag not given leaves the environment's, else the default)."""
    env = {}
    if tensor_parallel_size is not None:
        env["INFERMESH_ENGINE__TENSOR_PARALLEL_SIZE"] = str(tensor_parallel_size)
    if data_parallel_size is not None:
        env["INFERMESH_ENGINE__DATA_PARALLEL_SIZE"] = str(data_parallel_size)
    if enable_expert_parallel is not None:
        env["INFERMESH_ENGINE__ENABLE_EXPERT_PARALLEL"] = "true" if enable_expert_parallel else "false"
    if enable_eplb is not None:
        env["INFERMESH_ENGINE__ENABLE_EPLB"] = "true" if enable_eplb else "false"
    if eplb_config is not None:
        env["INFERMESH_ENGINE__EPLB_CONFIG"] = eplb_config
    return env


def _stage_of(name: str) -> str:
    """prefill-0 -> prefill; nats, kvcache, balancer -> themselves."""
    return name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


DEMO_PROMPT = "import os\n\n\ndef read_lines(path):\n"
"""The default model (models/trained) learned the stdlib's Python: a completion shows it best."""


def run_demo(mesh: Mesh) -> None:
    """Stream one completion with the official openai client, then show its trace."""
    import openai

    from tools.launch.trace_view import load_spans, pick_trace, render_waterfall

    client = openai.OpenAI(base_url=mesh.api_url, api_key="not-needed")
    model = client.models.list().data[0].id
    print(f"model: {model}\n{DEMO_PROMPT}", end="", flush=True)
    stream = client.completions.create(
        model=model,
        prompt=DEMO_PROMPT,
        max_tokens=64,
        temperature=0.7,
        seed=0,  # the same text on every run
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            print(chunk.choices[0].text, end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    print(f"\n\nusage: {usage}\n")
    time.sleep(1.0)  # the services export spans in batches every 200 ms
    print(render_waterfall(pick_trace(load_spans(mesh.trace_dir), "last")))


def served_names_env(names: list[str] | None) -> dict[str, str]:
    """--served-model-name as every process's balancer.model_name (the balancer answers to
    them; the workers' metrics carry the first); {} leaves the setting as it is."""
    if not names:
        return {}
    for name in names:
        if not name.strip() or "," in name:
            raise ValueError(f"--served-model-name: {name!r} is not a name (empty, or holds a comma)")
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name: names must be distinct, got {names}")
    return {"INFERMESH_BALANCER__MODEL_NAME": ",".join(names)}


def up(model: str, num_prefill: int, num_decode: int, port: int, state_dir: str, demo: bool,
       tensor_parallel_size: int | None = None, enable_expert_parallel: bool | None = None,
       enable_eplb: bool | None = None, eplb_config: str | None = None, num_vision: int = 0,
       data_parallel_size: int | None = None, planner_profile: str = "",
       served_model_names: list[str] | None = None) -> int:  # fmt: skip
    """Check, start with progress bars, serve until Ctrl-C or SIGTERM. A failure is
    one line on stderr (and, for a process that failed, the end of its log), not a
    traceback: exit code 2 for what was checked before starting, 1 after.
    tensor_parallel_size, enable_expert_parallel, enable_eplb, eplb_config: how each
    prefill and decode instance splits over ranks and balances its experts (the flags;
    None: INFERMESH_ENGINE__... or the default), checked here (EngineConfig's checks)
    and handed to every instance in its environment. data_parallel_size > 1 (the flag or
    INFERMESH_ENGINE__DATA_PARALLEL_SIZE, with enable_expert_parallel) makes each instance
    data-parallel over that many ranks, still one instance in the mesh
    (shared/engine/dp_kv.py). planner_profile: run the live
    planner on that profile (the mesh then scales itself). served_model_names: the
    names requests may ask for, the first the one responses carry (balancer.model_name)."""
    from tools.launch.preflight import PreflightError, preflight
    from tools.launch.progress import StartProgress

    parallel = parallel_env(tensor_parallel_size, enable_expert_parallel, enable_eplb, eplb_config, data_parallel_size)
    try:
        parallel.update(served_names_env(served_model_names))
    except ValueError as exc:
        print(f"infermesh: error: {exc}", file=sys.stderr)
        return 2
    mesh = Mesh(model, num_prefill, num_decode, port, Path(state_dir), supervise=True, extra_env=parallel,
                num_vision=num_vision, planner_profile=planner_profile)
    try:
        try:  # the engine settings every instance will read (EngineConfig's own checks run here)
            engine = load_settings(env={**os.environ, **parallel}).engine
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        preflight(model, num_prefill, num_decode, mesh.host, port, engine.tensor_parallel_size,
                  engine.enable_expert_parallel, engine.data_parallel_size)  # fmt: skip
        if planner_profile:
            from services.planner.profile import Profile

            try:
                Profile.load(planner_profile)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise PreflightError(f"--planner {planner_profile}: not a stage profile ({exc})") from None
    except PreflightError as exc:
        print(f"infermesh: error: {exc}", file=sys.stderr)
        return 2
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    progress = StartProgress(num_prefill + num_decode, 3 + num_prefill + num_decode + num_vision, Path(model).name)
    mesh.on_wait = progress.update
    try:
        print(f"starting the mesh: {num_prefill} prefill, {num_decode} decode, {num_vision} vision, model {model}",
              file=sys.stderr)
        try:
            mesh.start()
        finally:
            mesh.on_wait = None
            progress.close()
        print(f"InferMesh is up: OpenAI API at {mesh.api_url}  (logs and traces in {state_dir})", flush=True)
        if demo:
            run_demo(mesh)
            return 0
        print("Ctrl-C stops it; a process that dies is restarted.", file=sys.stderr)
        while True:
            time.sleep(1)
    except StartFailed as exc:
        print(f"infermesh: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping the mesh ...", file=sys.stderr)
        mesh.stop()
