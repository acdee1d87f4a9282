"""Per-instance NATS users under Helm (issue 11): the chart rendered by Helm's own
engine (helm_python), and a real nats-server run with the config and Secrets it
renders, TLS included, attacked as test_trust.py attacks `up`'s.

Each worker pod (a StatefulSet ordinal) logs in as itself, with exactly the
permissions `up` gives that instance; decode-1's credentials cannot publish on
decode-0's heartbeat, KV event or stream subjects, so neither the balancer's
subject fence nor anyone else ever sees such a message. A pod can read only its
own password; more pods than users is a render error naming the value to raise.
The chart's NATS takes only clients with a certificate of the chart's CA (each pod
presents its component's), and loads users added on upgrade without a restart
(its config-reloader sidecar, run here as the chart runs it)."""

import base64
import os
import re
import ssl
import subprocess

import pytest

helm = pytest.importorskip("helm_python")  # noqa: F841  (render_chart uses it)

from shared.runtime import subjects  # noqa: E402
from tests.helpers.mesh_procs import stop_process, wait_for_port  # noqa: E402
from tests.helpers.deploy_harness import containers, kinds, workloads  # noqa: E402
from tests.helpers.helm_chart import render_chart  # noqa: E402
from tests.helpers.nats_clients import Client, connected, settle, violations  # noqa: E402
from tools.launch.nats_auth import permissions  # noqa: E402
from tools.launch.up import find_nats_server, free_port  # noqa: E402

DECODE = "mesh-infermesh-decode-{}"
PREFILL = "mesh-infermesh-prefill-{}"


def secret_data(docs: list[dict], name: str) -> dict[str, str]:
    secret = kinds(docs, "Secret")[name]
    return {**{k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()},
            **secret.get("stringData", {})}


def component_of(user: str) -> str:
    """Whose certificate a NATS user's pod presents (the monitor has no pod: any of the mesh's)."""
    return next((c for c in ("prefill", "decode", "kvcache", "balancer") if c in user), "balancer")


class ChartNats:
    """nats-server with the chart's rendered config: its users, its TLS certificate
    (the chart's CA), the role passwords from the auth Secret in its environment; its
    config file and pid file where the pod has them (/etc/nats/conf, /var/run/nats),
    under folder."""

    def __init__(self, docs: list[dict], folder) -> None:  # noqa: ANN001
        self.folder = folder
        tls = secret_data(docs, "mesh-infermesh-tls")
        for sub in ("tls", "conf", "run", "certs"):
            (folder / sub).mkdir()
        for key, path in (("ca.crt", "ca.crt"), ("nats.crt", "tls.crt"), ("nats.key", "tls.key")):
            (folder / "tls" / path).write_text(tls[key])
        for component in ("prefill", "decode", "kvcache", "balancer"):  # what each pod mounts
            for ext in ("crt", "key"):
                (folder / "certs" / f"{component}.{ext}").write_text(tls[f"{component}.{ext}"])
        self.ca = folder / "tls" / "ca.crt"
        self.port = free_port()
        self.write_conf(docs)
        env = {**os.environ, **{k: v for k, v in secret_data(docs, "mesh-infermesh-auth").items()
                                if k.startswith("NATS_")}}
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(folder / "conf" / "auth.conf"),
                                      "--pid", str(folder / "run" / "nats.pid")], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)

    def local(self, text: str) -> str:
        """The pod's paths (the NATS container's mounts) as this machine's."""
        for path, sub in (("/etc/nats/tls", "tls"), ("/etc/nats/conf", "conf"), ("/var/run/nats", "run")):
            text = text.replace(path, str(self.folder / sub))
        return text

    def write_conf(self, docs: list[dict]) -> None:
        """The rendered config Secret's auth.conf, swapped in whole as kubelet updates a
        mounted Secret (a new file renamed over the old)."""
        conf = self.local(secret_data(docs, "mesh-infermesh-nats")["auth.conf"])
        assert str(self.folder / "tls" / "tls.crt") in conf, "the rendered config asks for TLS"
        assert "verify: true" in conf, "and for client certificates"
        new = self.folder / "auth.conf.new"
        new.write_text(f'listen: "127.0.0.1:{self.port}"\n' + conf)
        new.rename(self.folder / "conf" / "auth.conf")
        self.url = f"nats://127.0.0.1:{self.port}"  # 127.0.0.1 is among the certificate's names
        self.passwords = {**secret_data(docs, "mesh-infermesh-instances"),
                          **{r: secret_data(docs, "mesh-infermesh-auth")[f"NATS_{r.upper()}_PASSWORD"]
                             for r in ("balancer", "kvcache", "monitor")}}

    async def client(self, user: str, password: str | None = None, cert: str | None = "own") -> Client:
        """Logged in as user over TLS, presenting the certificate of user's pod (cert
        "own"), of another component, or none (None)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if cert is not None:
            name = component_of(user) if cert == "own" else cert
            context.load_cert_chain(self.folder / "certs" / f"{name}.crt", self.folder / "certs" / f"{name}.key")
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
        # The client certificate NATS asks for: the pod's own, from the TLS Secret's items for its stage.
        assert (env["INFERMESH_NATS__TLS_CERT"]["value"], env["INFERMESH_NATS__TLS_KEY"]["value"]) == (
            "/etc/infermesh/tls/tls.crt", "/etc/infermesh/tls/tls.key")
        (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert {i["key"] for i in tls["secret"]["items"]} == {"ca.crt", f"{stage}.crt", f"{stage}.key"}
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


@pytest.mark.asyncio
async def test_a_password_without_a_certificate_of_the_chart_ca_is_refused(chart_nats, tmp_path):
    """verify: the right user and password over TLS, but no client certificate, or one
    of another CA, never reach NATS's login: the handshake fails first."""
    import nats

    from tests.helpers.certs import make_ca, make_cert

    stranger = make_cert(tmp_path, make_ca(tmp_path, "stranger-ca"), "decode")
    for name in ("crt", "key"):
        (chart_nats.folder / "certs" / f"stranger.{name}").write_bytes(
            (stranger.cert if name == "crt" else stranger.key).read_bytes())
    for cert in (None, "stranger"):
        with pytest.raises(Exception) as refused:  # noqa: PT011  (an ssl error or a closed socket)
            c = await chart_nats.client(DECODE.format(0), cert=cert)
            await c.nc.close()
        assert "Authorization Violation" not in str(refused.value), cert
    # Another component's certificate of the same CA is a certificate of the mesh: the
    # password decides who it is (and what it may publish).
    c = await chart_nats.client(DECODE.format(0), cert="kvcache")
    await c.nc.close()


@pytest.mark.asyncio
async def test_users_added_on_upgrade_log_in_without_restarting_nats(tmp_path):
    """Installed with one decode pod, upgraded to two (lookup keeps the passwords): the
    config Secret changes, kubelet swaps the mounted file, and the chart's reloader
    sidecar (its own script, paths made local) has nats-server reload it in place: the
    new pod's user logs in within a few seconds; the server is the same process and a
    client connected before stays connected."""
    import asyncio

    import nats

    from tests.helpers.helm_chart import live_secrets

    values = {"nats": {"reloader": {"intervalSeconds": 1}}}
    installed = render_chart(values)
    server = ChartNats(installed, tmp_path)
    pod = workloads(installed)["mesh-nats"]["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True  # the sidecar signals nats-server in the other container
    (nats_c,) = [c for c in pod["containers"] if c["name"] == "nats"]
    assert "--pid=/var/run/nats/nats.pid" in nats_c["args"]
    (reloader,) = [c for c in pod["containers"] if c["name"] == "config-reloader"]
    assert {m["mountPath"] for m in reloader["volumeMounts"]} == {"/etc/nats/conf", "/etc/nats/tls", "/var/run/nats"}
    script = [server.local(a) for a in reloader["command"]]
    sidecar = subprocess.Popen(script, env={**os.environ, "PATH": f"{os.path.dirname(find_nats_server())}:"
                                            f"{os.environ['PATH']}"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        before = await server.client("balancer")
        new_pod = DECODE.format(1)
        upgraded = render_chart({**values, "stages": {"decode": {"replicas": 2}}}, live=live_secrets(installed))
        password = secret_data(upgraded, "mesh-infermesh-instances")[new_pod]
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # not a user yet
            await server.client(new_pod, password)
        server.write_conf(upgraded)
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                c = await server.client(new_pod, password)
                break
            except (nats.errors.Error, ConnectionError):  # refused (or reset mid-refusal) until the reload
                assert asyncio.get_running_loop().time() < deadline, "the new user was not loaded"
                await asyncio.sleep(0.3)
        await c.nc.close()
        assert server.proc.poll() is None and before.nc.is_connected  # reloaded, not restarted
        await before.nc.flush(timeout=2)
        # The users of before the upgrade keep their passwords.
        old = await server.client(DECODE.format(0), secret_data(installed, "mesh-infermesh-instances")[DECODE.format(0)])
        await old.nc.close()
        await before.nc.close()
    finally:
        sidecar.terminate()
        out = sidecar.communicate(timeout=10)[0]
        stop_process(server.proc)
    assert "reloaded" in out, out
