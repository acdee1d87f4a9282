"""The deployment harness of test_deploy.py: starts the compose services and the
chart's pods as local processes, with their own commands and environment (image
ENV, then ConfigMap, then container env), host names pointed at 127.0.0.1 and
container ports and paths at free local ones, and checks that they come up
healthy by the files' own health checks and probes.

Also here, since the harness needs them and test_deploy.py imports this module
(never the other way round): reading the rendered manifests (kinds, workloads,
containers), a container's environment as Kubernetes builds it, the image's ENV,
and the metric series the code defines."""

import base64
import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile
import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from deploy.nats_users import COMPOSE_INSTANCES
from tests.helpers.mesh_procs import ROOT, free_port, start_service
from tools.launch.up import find_nats_server, grpc_serving, http_ok

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
# Settings that name a port the process itself listens on.
OWN_PORT_KEYS = ("INFERMESH_WORKER__GRPC_PORT", "INFERMESH_WORKER__METRICS_PORT", "INFERMESH_BALANCER__PORT")
HEALTH_TIMEOUT_S = 120.0


# -- what the files say: manifests, environments, the image, the metrics ---------------------------


def code_metric_series() -> set[str]:
    """Every series name the services expose, read off the code: Metrics.counter /
    gauge / histogram calls, with the stage from the folder (services/<stage>/, sub-packages included) or,
    for the shared Worker, every stage whose service uses it. prometheus_client's
    suffixes are added: counters _total and _created, histograms _bucket, _sum,
    _count and _created."""
    pattern = re.compile(r"\.(counter|gauge|histogram)\(\s*\"([a-z0-9_]+)\"")
    worker_stages = {p.parent.name for p in (ROOT / "services").glob("*/*.py")
                     if "from shared.stage.worker import" in p.read_text() and "Worker" in p.read_text()}
    series: set[str] = set()
    for path in [*(ROOT / "services").rglob("*.py"), ROOT / "shared" / "stage" / "worker.py"]:
        # A stage's metrics may sit in its sub-packages (the balancer's frontend/ and router/).
        stages = worker_stages if path.parent.name == "stage" else {path.relative_to(ROOT / "services").parts[0]}
        for kind, name in pattern.findall(path.read_text()):
            for stage in stages:
                base = f"infermesh_{stage}_{name}"
                if kind == "counter":
                    base = base.removesuffix("_total")
                    series |= {base + "_total", base + "_created"}
                elif kind == "histogram":
                    series |= {base + s for s in ("_bucket", "_sum", "_count", "_created")}
                else:
                    series.add(base)
    assert worker_stages >= {"prefill", "decode"} and len(series) > 40, "the metric grep found too little"
    # vLLM's own names, beside them (shared/runtime/vllm_metrics.py says which process exports which).
    vllm = re.compile(r"\b(counter|gauge|histogram|Counter|Gauge)\(\s*(?:r,\s*)?\"(vllm:[a-z0-9_]+)\"")
    found = 0
    for path in (ROOT / "shared" / "runtime" / "vllm_metrics.py", ROOT / "shared" / "stage" / "engine_metrics.py"):
        for kind, name in vllm.findall(path.read_text()):
            found += 1
            if kind.lower() == "counter":
                series |= {name + "_total", name + "_created"}
            elif kind == "histogram":
                series |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
            else:
                series.add(name)
    assert found >= 17, "the vLLM metric grep found too little"
    return series


def kinds(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {**kinds(docs, "Deployment"), **kinds(docs, "StatefulSet")}


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def dockerfile_final_stage() -> list:
    commands = dockerfile.parse_file(str(DOCKERFILE))
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return commands[last_from:]


def image_env() -> dict[str, str]:
    """ENV of the image's final stage (HOME and PATH are the machine's here)."""
    env: dict[str, str] = {}
    for c in dockerfile_final_stage():
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2], strict=True))
    return {k: v for k, v in env.items() if k not in ("HOME", "PATH")}


def secret_value(ref: dict, secrets: dict[str, dict]) -> str:
    """A secretKeyRef's value from the rendered Secrets."""
    secret = secrets[ref["name"]]
    if ref["key"] in secret.get("stringData", {}):
        return secret["stringData"][ref["key"]]
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def container_env(container: dict, configmaps: dict[str, dict], secrets: dict[str, dict],
                  base: dict[str, str] | None = None, pod_name: str = "pod-0") -> dict[str, str]:
    """A container's environment as Kubernetes builds it: image ENV, then the
    ConfigMaps of envFrom, then env (values with $(VAR) of earlier entries expanded,
    secretKeyRefs to the rendered Secrets, the pod's name by fieldRef)."""
    env = image_env() if base is None else dict(base)
    for ref in container.get("envFrom", []):
        env.update(configmaps[ref["configMapRef"]["name"]]["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e["valueFrom"]:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
            env[e["name"]] = pod_name
        else:
            env[e["name"]] = secret_value(e["valueFrom"]["secretKeyRef"], secrets)
    return env


# -- starting the mesh as compose and the chart do --------------------------------------------------


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Stands in for Jaeger / the collector: records which services export spans."""

    def __init__(self, port: int) -> None:
        self.services: set[str] = set()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def Export(self, request, context):  # the gRPC method's name
        for spans in request.resource_spans:
            self.services |= {a.value.string_value for a in spans.resource.attributes if a.key == "service.name"}
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class Local:
    """Where containers' names land on this machine: each (host, port) a free
    local port, each container path a folder under tmp."""

    hosts: set[str]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def port(self, host: str, port: int) -> int:
        return self.ports.setdefault((host, port), free_port())

    def text(self, value: str, own: str, paths: dict[str, Path]) -> str:
        """Host names (127.0.0.1 and localhost being the container `own`) and paths."""
        def host(m: re.Match) -> str:
            name = own if m.group(1) in ("127.0.0.1", "localhost") else m.group(1)
            return f"127.0.0.1:{self.port(name, int(m.group(2)))}"

        names = "|".join(map(re.escape, sorted(self.hosts | {"127.0.0.1", "localhost"}, key=len, reverse=True)))
        # A port ends where its digits do: `balancer:9e6c...` (a gRPC peers entry) is no address.
        value = re.sub(rf"(?<![\w.-])({names}):(\d+)(?!\w)", host, value)
        for prefix in sorted(paths, key=len, reverse=True):
            value = re.sub(rf"(?<![\w/.]){re.escape(prefix)}(?=/|$|\s|\")", str(paths[prefix]), value)
        return value

    def env(self, env: dict[str, str], own: str, paths: dict[str, Path]) -> dict[str, str]:
        out = {k: self.text(v, own, paths) for k, v in env.items()}
        out.update({k: str(self.port(own, int(env[k]))) for k in OWN_PORT_KEYS if k in env})
        return out

    def nats_command(self, args: list[str], own: str, paths: dict[str, Path]) -> list[str]:
        """nats-server with the file's flags, its ports and store folder made local."""
        out, rest = [], list(args)
        while rest:
            flag, _, value = rest.pop(0).partition("=")
            paths_flags = ("--store_dir", "-sd", "--config", "-c", "--tlscert", "--tlskey", "--tlscacert", "--pid", "-P")
            if flag in ("--port", "-p", "--http_port", "-m", *paths_flags):
                value = value or rest.pop(0)
                is_dir = flag in paths_flags
                out += [flag, self.text(value, own, paths) if is_dir else str(self.port(own, int(value)))]
            else:
                out.append(flag + (f"={value}" if value else ""))
        if not {"--port", "-p"} & set(out):
            out += ["--port", str(self.port(own, 4222))]
        return [find_nats_server(), "-a", "127.0.0.1", *out]


@dataclass
class Spec:
    """One container as this machine runs it. No checks: a one-shot command
    (init container, model-init) that must exit 0 before the next starts."""

    name: str
    command: list[str]
    env: dict[str, str]
    checks: list[tuple[str, object]] = field(default_factory=list)
    wait: bool = False  # healthy before the next container starts (depends_on, or what workers dial)
    sidecar: bool = False  # runs beside its pod's main container, with no probe of its own


@dataclass
class Proc:
    spec: Spec
    proc: subprocess.Popen


def healthy(check: tuple[str, object]) -> bool:
    kind, what = check
    if kind == "grpc":
        return grpc_serving(str(what))
    if kind == "exec":  # a pod's exec probe: run in the container's environment
        argv, env = what  # type: ignore[misc]
        argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
        return subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, timeout=30).returncode == 0
    if kind == "http":
        return http_ok(str(what))
    argv = list(what)  # a compose healthcheck command
    if argv[0] == "wget":  # the nats and prometheus images' busybox wget: the same GET
        return http_ok(argv[-1])
    argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=30).returncode == 0


def launch(spec: Spec, logs: Path) -> subprocess.Popen:
    if spec.command[:2] == ["python", "-m"]:
        assert len(spec.command) == 3 and re.fullmatch(r"services\.\w+", spec.command[2]), spec.command
        return start_service(spec.command[2].split(".")[1], spec.env, logs / f"{spec.name}.log")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **spec.env}
    with (logs / f"{spec.name}.log").open("ab") as log:
        return subprocess.Popen(spec.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(procs: list[Proc], which: list[Proc], logs: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    pending = [(p, c) for p in which for c in p.spec.checks]
    while pending:
        for p in procs:
            if p.proc.poll() is not None:
                log = (logs / f"{p.spec.name}.log").read_text()[-3000:]
                pytest.fail(f"{p.spec.name} exited with {p.proc.returncode}:\n{log}")
        pending = [(p, c) for p, c in pending if not healthy(c)]
        if pending and time.monotonic() > deadline:
            pytest.fail(f"not healthy after {HEALTH_TIMEOUT_S:.0f}s: {[(p.spec.name, c) for p, c in pending]}")
        time.sleep(0.3 if pending else 0)


def nats_refuses_strangers(env: dict[str, str], tmp: Path) -> None:
    """The files' NATS takes no client without a user (over TLS with the mesh's CA where
    the files say so) and, where they give services client certificates, none without a
    certificate of the mesh's CA either: the right CA alone, or a certificate of another
    CA, is refused in the TLS handshake; the service's own certificate without a user
    gets as far as NATS's Authorization Violation."""
    import asyncio
    import ssl

    import nats

    from tests.helpers.certs import make_ca, make_cert

    url, tls_ca, tls_cert, tls_key = (env.get(f"INFERMESH_NATS__{k}") for k in ("URL", "TLS_CA", "TLS_CERT", "TLS_KEY"))

    async def refusal(cert: tuple[str, str] | None) -> str:
        tls = None
        if tls_ca:
            tls = ssl.create_default_context(cafile=tls_ca)
            if cert is not None:
                tls.load_cert_chain(*cert)
        try:
            nc = await asyncio.wait_for(nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0,
                                                     connect_timeout=3, tls=tls), 15)
        except Exception as exc:  # noqa: BLE001  (a TLS refusal comes through as the ssl error, or a closed socket)
            return f"{type(exc).__name__}: {exc}"
        await nc.close()
        return ""

    if not tls_cert:
        assert "Authorization Violation" in asyncio.run(refusal(None))
        return
    assert tls_ca and tls_key
    own = asyncio.run(refusal((tls_cert, tls_key)))
    assert "Authorization Violation" in own, own
    other_ca = make_ca(tmp / "stranger", "stranger-ca")
    other = make_cert(tmp / "stranger", other_ca, "stranger")
    for cert in (None, (str(other.cert), str(other.key))):
        refused = asyncio.run(refusal(cert))
        assert refused and "Authorization Violation" not in refused, (cert, refused)  # refused before any user


def run_mesh(specs: list[Spec], procs: list[Proc], logs: Path, api: str, receiver: OtlpReceiver) -> None:
    """Start in order, then: all healthy, one completion, every service's
    metrics its own and defined in the code, spans at the OTLP endpoint."""
    for spec in specs:
        if not spec.checks and not spec.sidecar:
            proc = launch(spec, logs)
            assert proc.wait(120) == 0, (logs / f"{spec.name}.log").read_text()[-3000:]
            continue
        procs.append(Proc(spec, launch(spec, logs)))
        if spec.wait:
            wait_healthy(procs, procs[-1:], logs)
    wait_healthy(procs, procs, logs)

    balancer = next(p.spec for p in procs if p.spec.command[-1:] == ["services.balancer"])
    # The files' NATS has its users, speaks TLS with the mesh's CA and asks for client certificates.
    nats_refuses_strangers(balancer.env, logs.parent)
    key = balancer.env["INFERMESH_BALANCER__API_KEY"]
    assert httpx.get(f"{api}/v1/models", timeout=30).status_code == 401  # closed by default
    auth = {"Authorization": f"Bearer {key}"}
    model = httpx.get(f"{api}/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    reply = httpx.post(f"{api}/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 4},
                       headers=auth, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    # kvcache is a soft dependency, so a completion alone would pass without it: the
    # balancer reaches it (over mutual TLS where the files say so).
    assert httpx.get(f"{api}/ready", timeout=10).json()["kvcache"] == "up"

    series = code_metric_series()
    for p in procs:
        if p.spec.command[:2] != ["python", "-m"]:
            continue
        stage = p.spec.command[2].split(".")[1]
        url = f"http://127.0.0.1:{p.spec.env['INFERMESH_WORKER__METRICS_PORT']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            names = {s.name for f in text_string_to_metric_families(resp.read().decode()) for s in f.samples}
        assert names and all(n.startswith((f"infermesh_{stage}_", "vllm:")) for n in names), (p.spec.name, names)
        assert names <= series, f"{p.spec.name} exports series the code grep misses: {names - series}"

    deadline = time.monotonic() + 15
    while not {"balancer", "prefill", "decode", "kvcache"} <= receiver.services and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {"balancer", "prefill", "decode", "kvcache"} <= receiver.services


def compose_specs(services: dict, local: Local, tmp: Path, models_dir: Path, scale: dict[str, int]) -> list[Spec]:
    """The compose services in depends_on order, `scale` containers of a
    service as `--scale` makes them; jaeger is the OTLP receiver, Prometheus
    and Grafana are not ours to start."""
    # The workers of the profiles given (vision-0 only under `vision`).
    order = ["certs", "nats", "model-init", "kvcache", *(n for n in COMPOSE_INSTANCES if n in services), "balancer"]
    assert set(services) - {"jaeger", "prometheus", "grafana"} == set(order)
    started = {"jaeger"}
    specs = []
    for name in order:
        svc = services[name]
        assert set(svc.get("depends_on", {})) <= started, f"{name} starts before its dependencies"
        started.add(name)
        for replica in range(1, scale.get(name, 1) + 1):
            own = name if replica == 1 else f"{name}-{replica}"  # its own ports and state
            # A named volume is one folder, whoever mounts it (a subpath: that folder of it, which
            # must exist, as Docker requires); the rest of the image's state is the container's.
            paths = {v["target"]: Path(v["source"]) if v["type"] == "bind"
                     else models_dir if v["source"] == "models"
                     else tmp / "volumes" / v["source"] / v.get("volume", {}).get("subpath", "")
                     for v in svc.get("volumes", [])}
            paths.setdefault("/var/lib/infermesh", tmp / own / "state")
            subpaths = {paths[v["target"]] for v in svc.get("volumes", []) if v.get("volume", {}).get("subpath")}
            for folder in set(paths.values()) - subpaths:  # Docker makes a volume's folder when it mounts it
                if not folder.suffix:
                    folder.mkdir(parents=True, exist_ok=True)
            env = {k: v.replace("$$", "$") for k, v in svc.get("environment", {}).items()}  # compose's $$ is $
            env = local.env({**image_env(), **env} if "build" in svc else env, own, paths)
            command = [local.text(a.replace("$$", "$"), own, paths) for a in svc["command"]]
            if name == "nats":
                assert svc["image"].startswith("nats:")
                command = local.nats_command(command, own, paths)
            checks = []
            if "healthcheck" in svc:
                test = svc["healthcheck"]["test"]
                argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
                argv = [local.text(a, own, paths) for a in argv]
                # A health check runs inside the container, with its environment (its certificates).
                checks = [("cmd", argv) if argv[0] == "wget" else ("exec", (argv, env))]
            conditions = [s["depends_on"][name]["condition"] for s in services.values()
                          if name in s.get("depends_on", {})]
            specs.append(Spec(own, command, env, checks, wait="service_healthy" in conditions))
    return specs


def chart_specs(docs: list[dict], local: Local, tmp: Path, models_dir: Path) -> list[Spec]:
    """Each workload's pod (one replica): init containers, then the container
    with its liveness and readiness probes as checks."""
    configmaps, services, pods = kinds(docs, "ConfigMap"), kinds(docs, "Service"), workloads(docs)
    secrets = kinds(docs, "Secret")
    order = ["mesh-nats", "mesh-infermesh-kvcache", "mesh-infermesh-prefill", "mesh-infermesh-decode",
             "mesh-infermesh-balancer"]
    assert set(pods) == set(order)
    specs = []
    for name in order:
        labels = pods[name]["spec"]["template"]["metadata"]["labels"]
        own = next(s for s, svc in services.items() if svc["spec"]["selector"].items() <= labels.items())
        pod = pods[name]["spec"]["template"]["spec"]
        demo_model = "emptyDir" in next((v for v in pod.get("volumes", []) if v["name"] == "models"), {})
        for c in containers(pod):
            # The demo model's emptyDir is one folder for all pods here: make-model is deterministic.
            paths = {m["mountPath"]: models_dir if m["name"] == "models" and demo_model else tmp / name / m["name"]
                     for m in c.get("volumeMounts", [])}
            for volume in pod.get("volumes", []):  # a ConfigMap or Secret volume: its keys (or items) as files
                folder = tmp / name / volume["name"]
                if "configMap" in volume:
                    folder.mkdir(parents=True, exist_ok=True)
                    for key, text in configmaps[volume["configMap"]["name"]]["data"].items():
                        (folder / key).write_text(text)
                if "secret" in volume:
                    folder.mkdir(parents=True, exist_ok=True)
                    secret = secrets[volume["secret"]["secretName"]]
                    data = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
                    # A config names container paths (NATS's certificates): made local like the rest.
                    data |= {k: local.text(v, own, paths).encode() for k, v in secret.get("stringData", {}).items()}
                    items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
                    for item in items:
                        (folder / item["path"]).write_bytes(data[item["key"]])
                if "emptyDir" in volume:
                    folder.mkdir(parents=True, exist_ok=True)
            if c["image"].startswith("nats:") and c["name"] == "nats":
                specs.append(Spec(name, local.nats_command(c["args"], own, paths),
                                  container_env(c, configmaps, secrets, base={}), wait=True))
            elif c["image"].startswith("nats:"):  # the config reloader: its script, with this nats-server
                assert c["name"] == "config-reloader" and "livenessProbe" not in c, c["name"]
                path = f"{Path(find_nats_server()).parent}:{os.environ['PATH']}"
                specs.append(Spec(f"{name}-{c['name']}", [local.text(a, own, paths) for a in c["command"]],
                                  {"PATH": path}, sidecar=True))
                continue
            else:
                specs.append(Spec(f"{name}-{c['name']}", [local.text(a, own, paths) for a in c["command"]],
                                  local.env(container_env(c, configmaps, secrets, pod_name=f"{name}-0"), own, paths),
                                  wait=name.endswith("kvcache")))
            if c in pod["containers"]:
                named = {p["name"]: p["containerPort"] for p in c["ports"]}
                for probe in (c["livenessProbe"], c["readinessProbe"]):
                    if "grpc" in probe:
                        specs[-1].checks.append(("grpc", f"127.0.0.1:{local.port(own, probe['grpc']['port'])}"))
                    elif "exec" in probe:
                        argv = [local.text(a, own, paths) for a in probe["exec"]["command"]]
                        specs[-1].checks.append(("exec", (argv, specs[-1].env)))
                    else:
                        port = local.port(own, int(named.get(probe["httpGet"]["port"], probe["httpGet"]["port"])))
                        specs[-1].checks.append(("http", f"http://127.0.0.1:{port}{probe['httpGet']['path']}"))
    return specs

