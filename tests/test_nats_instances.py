"""Per-instance NATS users under Helm (issue 11): the chart rendered by Helm's own
engine (helm_python), and a real nats-server run with the config and Secrets it
renders, TLS included, attacked as test_trust.py attacks `up`'s.

Each worker pod (a StatefulSet ordinal) logs in as itself, with exactly the
permissions `up` gives that instance; decode-1's credentials cannot publish on
decode-0's heartbeat, KV event or stream subjects, so neither the balancer's
subject fence nor anyone else ever sees such a message. A pod can read only its
own password; more pods than users is a render error naming the value to raise."""

import base64
import os
import re
import ssl
import subprocess

import pytest

helm = pytest.importorskip("helm_python")  # noqa: F841  (render_chart uses it)

from shared.runtime import subjects  # noqa: E402
from tests.mesh_procs import stop_process, wait_for_port  # noqa: E402
from tests.test_deploy import containers, kinds, render_chart, workloads  # noqa: E402
from tests.test_trust import Client, connected, settle, violations  # noqa: E402
from tools.launch.nats_auth import permissions  # noqa: E402
from tools.launch.up import find_nats_server, free_port  # noqa: E402

DECODE = "mesh-infermesh-decode-{}"
PREFILL = "mesh-infermesh-prefill-{}"


def secret_data(docs: list[dict], name: str) -> dict[str, str]:
    secret = kinds(docs, "Secret")[name]
    return {**{k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()},
            **secret.get("stringData", {})}


class ChartNats:
    """nats-server with the chart's rendered config: its users, its TLS certificate
    (the chart's CA), the role passwords from the auth Secret in its environment."""

    def __init__(self, docs: list[dict], folder) -> None:  # noqa: ANN001
        tls = secret_data(docs, "mesh-infermesh-tls")
        (folder / "tls").mkdir()
        for key, path in (("ca.crt", "ca.crt"), ("nats.crt", "tls.crt"), ("nats.key", "tls.key")):
            (folder / "tls" / path).write_text(tls[key])
        self.ca = folder / "tls" / "ca.crt"
        conf = secret_data(docs, "mesh-infermesh-nats")["auth.conf"].replace("/etc/nats/tls", str(folder / "tls"))
        assert str(folder / "tls" / "tls.crt") in conf, "the rendered config asks for TLS"
        self.port = free_port()
        (folder / "nats.conf").write_text(f'listen: "127.0.0.1:{self.port}"\n' + conf)
        env = {**os.environ, **{k: v for k, v in secret_data(docs, "mesh-infermesh-auth").items()
                                if k.startswith("NATS_")}}
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(folder / "nats.conf")], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)
        self.url = f"nats://127.0.0.1:{self.port}"  # 127.0.0.1 is among the certificate's names
        self.passwords = {**secret_data(docs, "mesh-infermesh-instances"),
                          **{r: secret_data(docs, "mesh-infermesh-auth")[f"NATS_{r.upper()}_PASSWORD"]
                             for r in ("balancer", "kvcache", "monitor")}}

    async def client(self, user: str, password: str | None = None) -> Client:
        context = ssl.create_default_context(cafile=str(self.ca))
        c = Client()
        import nats

        from shared.runtime.bus import inbox_prefix

        async def on_error(exc: Exception) -> None:
            c.errors.append(str(exc))

        c.nc = await nats.connect(self.url, user=user, password=password or self.passwords[user], tls=context,
                                  inbox_prefix=inbox_prefix(user), allow_reconnect=False,
                                  max_reconnect_attempts=0, connect_timeout=3, error_cb=on_error)
        return c


@pytest.fixture(scope="module")
def chart_docs() -> list[dict]:
    return render_chart({"stages": {"decode": {"replicas": 2}}})


@pytest.fixture(scope="module")
def chart_nats(chart_docs, tmp_path_factory):
    server = ChartNats(chart_docs, tmp_path_factory.mktemp("chart-nats"))
    yield server
    stop_process(server.proc)


def test_one_user_per_pod_with_the_permissions_up_gives_that_instance(chart_docs):
    conf = secret_data(chart_docs, "mesh-infermesh-nats")["auth.conf"]
    pods = [DECODE.format(0), DECODE.format(1), PREFILL.format(0)]
    assert set(secret_data(chart_docs, "mesh-infermesh-instances")) == set(pods)
    for pod in pods:
        role = "decode" if "decode" in pod else "prefill"
        (entry,) = re.findall(rf'\{{user: "{pod}", password: "(\w+)", permissions: \{{\n(.*?)\n      \}}\}}', conf,
                              re.S)
        want = permissions(role, pod)
        assert f"publish: {{allow: {list(want.publish)}}}".replace("'", '"') in entry[1], pod
        assert f'"_INBOX.{pod}.>"' in entry[1] and all(f'"{s}"' in entry[1] for s in want.subscribe), pod
        assert entry[0] == secret_data(chart_docs, "mesh-infermesh-instances")[pod]
    # No user a whole stage shares any more.
    assert not re.search(r'user: "(prefill|decode)"', conf)


def test_each_pod_reads_only_its_own_password(chart_docs):
    for stage in ("prefill", "decode"):
        pod = workloads(chart_docs)[f"mesh-infermesh-{stage}"]["spec"]["template"]["spec"]
        init, main = pod["initContainers"][0], pod["containers"][0]
        assert init["name"] == "nats-credentials"
        assert {m["name"] for m in init["volumeMounts"]} == {"nats-users", "nats-credentials"}
        # The worker mounts its copied password, never the Secret of every instance.
        assert "nats-users" not in {m["name"] for c in containers(pod) if c is not init
                                    for m in c.get("volumeMounts", [])}
        env = {e["name"]: e for e in main["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["INFERMESH_NATS__USER"]["value"] == env["INFERMESH_WORKER__INSTANCE_ID"]["value"] == "$(POD_NAME)"
        assert env["INFERMESH_NATS__PASSWORD_FILE"]["value"].startswith(
            next(m["mountPath"] for m in main["volumeMounts"] if m["name"] == "nats-credentials"))
        assert env["INFERMESH_NATS__TLS_CA"]["value"] == "/etc/infermesh/tls/ca.crt"
        assert "INFERMESH_NATS__PASSWORD" not in env


def test_more_pods_than_users_fails_the_render_naming_the_value():
    with pytest.raises(Exception, match=r"stages.decode.maxInstances"):
        render_chart({"stages": {"decode": {"replicas": 3, "maxInstances": 2}}})
    with pytest.raises(Exception, match=r"stages.prefill.maxInstances=8"):
        render_chart({"stages": {"prefill": {"autoscaling": {"enabled": True, "maxReplicas": 8}, "maxInstances": 4}}})
    # Autoscaling: a user for every pod the HPA may make.
    docs = render_chart({"stages": {"decode": {"autoscaling": {"enabled": True, "maxReplicas": 5}}}})
    assert set(secret_data(docs, "mesh-infermesh-instances")) >= {DECODE.format(i) for i in range(5)}


@pytest.mark.asyncio
async def test_decode_1_cannot_speak_on_decode_0s_subjects(chart_nats):
    balancer = await chart_nats.client("balancer")
    attacker = await chart_nats.client(DECODE.format(1))
    victim = DECODE.format(0)
    try:
        heartbeats = await balancer.received(subjects.HEARTBEAT_ALL)
        events = await balancer.received(subjects.KV_EVENTS_ALL)
        streams = await balancer.received(subjects.stream_of_instance(victim))
        # Its own heartbeat arrives (the connection works, over TLS, as itself).
        await connected(attacker, subjects.heartbeat("decode", DECODE.format(1)), heartbeats, balancer)
        await attacker.nc.publish(subjects.heartbeat("decode", victim), b"forged heartbeat")
        await attacker.nc.publish(subjects.kv_events(victim), b"forged kv event")
        await attacker.nc.publish(subjects.stream(victim, "req-1"), b"forged tokens")
        await settle(attacker, balancer)
        assert heartbeats == [] and events == [] and streams == []
        assert len(violations(attacker, "publish")) == 3, attacker.errors
        # decode-0 itself may (the refusals above are the per-instance permissions).
        owner = await chart_nats.client(victim)
        await owner.nc.publish(subjects.stream(victim, "req-1"), b"tokens")
        await owner.nc.publish(subjects.heartbeat("decode", victim), b"beat")
        await settle(owner, balancer, until=lambda: streams and heartbeats)
        assert [m.data for m in streams] == [b"tokens"] and [m.data for m in heartbeats] == [b"beat"]
        await owner.nc.close()
    finally:
        await balancer.nc.close()
        await attacker.nc.close()


@pytest.mark.asyncio
async def test_the_chart_nats_refuses_a_stage_user_a_wrong_password_and_plaintext(chart_nats):
    import nats

    for user, password in (("decode", chart_nats.passwords[DECODE.format(0)]),
                           (DECODE.format(0), chart_nats.passwords[DECODE.format(1)])):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await chart_nats.client(user, password)
    # Without TLS (no CA: nats-py falls back on the system's, which never signed the chart's CA).
    with pytest.raises(Exception) as refused:  # noqa: PT011
        await nats.connect(chart_nats.url, user="balancer", password=chart_nats.passwords["balancer"],
                           allow_reconnect=False, connect_timeout=3)
    assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value)
