"""NATS over TLS (issue 11): a real nats-server with a certificate of a CA made by
openssl here, and the mesh's one bus helper (shared/runtime/bus.py) as every
service connects.

A client given that CA (nats.tls_ca) connects, logs in and moves messages; one
with another CA, or with none (the system's CAs), is refused during the
handshake; a client told to use TLS refuses a server that does not speak it.
The password may come from a file (nats.password_file, how Helm hands each pod
its own)."""

import asyncio
import ssl
import subprocess
from pathlib import Path

import nats
import pytest

from shared.runtime.bus import Bus, nats_password, nats_tls
from shared.runtime.settings import NatsSettings, load_settings
from tests.helpers.certs import make_ca, make_cert
from tests.helpers.mesh_procs import stop_process, wait_for_port
from tools.launch.nats_auth import MeshCredentials
from tools.launch.up import find_nats_server, free_port

CONNECT_LIMIT_S = 15.0  # a refused handshake must fail, not retry forever


class TlsNats:
    """nats-server on loopback with a user of `up` (its operator's, which may use any
    subject) and TLS from the flags compose passes too (--tls, --tlscert, --tlskey)."""

    def __init__(self, folder: Path, tls: bool = True, verify: bool = False) -> None:
        self.port = free_port()
        self.creds = MeshCredentials()
        self.user = self.creds.add("admin", "admin")
        conf = folder / "nats.conf"
        self.creds.write_config(conf, "127.0.0.1", self.port)
        self.ca = make_ca(folder / "ca", "mesh-ca")
        server = make_cert(folder / "ca", self.ca, "nats", sans="IP:127.0.0.1,DNS:localhost")
        args = [find_nats_server(), "-c", str(conf)]
        if tls:
            args += ["--tls", "--tlscert", str(server.cert), "--tlskey", str(server.key)]
        if verify:  # clients must present a certificate of the CA too (compose's flags)
            args += ["--tlsverify", "--tlscacert", str(self.ca.cert)]
        self.client_cert = make_cert(folder / "ca", self.ca, "decode-0", sans="DNS:decode-0")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)

    def settings(self, host: str = "127.0.0.1", **kw: object) -> NatsSettings:
        fields = {"url": f"nats://{host}:{self.port}", "user": self.user.name, "password": self.user.password,
                  "tls_ca": str(self.ca.cert), "connect_timeout_s": 3.0, **kw}
        return NatsSettings(**fields)  # type: ignore[arg-type]


async def connect_once(settings: NatsSettings) -> nats.NATS:
    """What Bus.connect does (its password and TLS context), without its endless
    reconnects (a service outlives a NATS restart; a refused test must end)."""
    return await asyncio.wait_for(nats.connect(
        settings.url, user=settings.user, password=nats_password(settings), tls=nats_tls(settings),
        allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3), CONNECT_LIMIT_S)


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory):
    server = TlsNats(tmp_path_factory.mktemp("nats-tls"))
    yield server
    stop_process(server.proc)


async def round_trip(bus: Bus) -> bytes:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        got.put_nowait(msg.data)

    await bus.nc.subscribe("tls.echo", cb=on_msg)
    await bus.nc.publish("tls.echo", b"over tls")
    return await asyncio.wait_for(got.get(), 5)


@pytest.mark.asyncio
async def test_a_client_with_the_ca_connects_over_tls(tls_nats):
    bus = await asyncio.wait_for(Bus.connect(tls_nats.settings(), name="admin"), CONNECT_LIMIT_S)
    try:
        assert bus.nc._server_info["tls_required"] is True
        assert bus.nc._transport._io_writer.get_extra_info("ssl_object") is not None  # the socket is TLS
        assert await round_trip(bus) == b"over tls"
    finally:
        await bus.close()
    # By the name the certificate carries too (host name checked, not only the chain).
    bus = await asyncio.wait_for(Bus.connect(tls_nats.settings(host="localhost"), name="admin"), CONNECT_LIMIT_S)
    await bus.close()


@pytest.mark.asyncio
async def test_the_password_comes_from_a_file(tls_nats, tmp_path):
    secret = tmp_path / "password"
    secret.write_text(tls_nats.user.password + "\n")  # as a Secret's file may end
    settings = tls_nats.settings(password=None, password_file=str(secret))
    bus = await asyncio.wait_for(Bus.connect(settings, name="admin"), CONNECT_LIMIT_S)
    await bus.close()
    secret.write_text("not-the-password")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect_once(settings)
    with pytest.raises(ValueError, match="password_file"):
        await Bus.connect(tls_nats.settings(password=None, password_file=str(tmp_path / "missing")), name="x")


@pytest.mark.asyncio
async def test_a_client_with_another_ca_or_none_is_refused(tls_nats, tmp_path):
    other = make_ca(tmp_path, "other-ca")
    # Another CA: the server's certificate does not verify. The right password does not help.
    with pytest.raises(Exception) as refused:  # noqa: PT011  (nats-py passes the ssl error through as is)
        await connect_once(tls_nats.settings(tls_ca=str(other.cert)))
    assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value) or "certificate verify failed" in str(refused.value)
    # No CA at all: the server requires TLS, nats-py falls back on the system's CAs, which never signed it.
    with pytest.raises(Exception) as refused:  # noqa: PT011
        await asyncio.wait_for(nats.connect(tls_nats.settings().url, user="admin",
                                            password=tls_nats.user.password, allow_reconnect=False,
                                            connect_timeout=3), CONNECT_LIMIT_S)
    assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value) or "certificate verify failed" in str(refused.value)
    # The host name is checked too (only the CA given is trusted, not the system's).
    context = nats_tls(tls_nats.settings())
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "mesh-ca"),),)]


@pytest.mark.asyncio
async def test_a_tls_client_refuses_a_server_without_tls(tmp_path):
    plain = TlsNats(tmp_path, tls=False)
    try:
        with pytest.raises(ConnectionError, match="does not speak TLS"):
            await asyncio.wait_for(Bus.connect(plain.settings(), name="admin"), CONNECT_LIMIT_S)
        # Without a CA the same client connects in plaintext (what `up` does on loopback).
        bus = await asyncio.wait_for(Bus.connect(plain.settings(tls_ca=None), name="admin"), CONNECT_LIMIT_S)
        await bus.close()
    finally:
        stop_process(plain.proc)


def test_tls_settings_come_from_env_and_half_a_client_pair_is_refused(tmp_path):
    env = {"INFERMESH_NATS__TLS_CA": "/etc/infermesh/tls/ca.crt",
           "INFERMESH_NATS__PASSWORD_FILE": "/var/run/infermesh/nats/password"}
    nats_settings = load_settings(env=env).nats
    assert (nats_settings.tls_ca, nats_settings.password_file) == tuple(env.values())
    with pytest.raises(ValueError, match="tls_cert and nats.tls_key"):
        nats_tls(NatsSettings(tls_ca=str(make_ca(tmp_path, "ca").cert), tls_cert="/x.pem"))
    with pytest.raises(ValueError, match="need nats.tls_ca"):
        nats_tls(NatsSettings(tls_cert="/x.pem", tls_key="/x.key"))


@pytest.mark.asyncio
async def test_with_tlsverify_only_a_client_with_a_certificate_of_the_ca_gets_to_log_in(tmp_path):
    """compose's NATS (--tlsverify --tlscacert): the bus presents nats.tls_cert and logs
    in; the right password without a certificate, or with one of another CA, is refused
    in the handshake, before any login; the certificate without the password is not
    enough either."""
    server = TlsNats(tmp_path, verify=True)
    try:
        own = {"tls_cert": str(server.client_cert.cert), "tls_key": str(server.client_cert.key)}
        bus = await asyncio.wait_for(Bus.connect(server.settings(**own), name="admin"), CONNECT_LIMIT_S)
        assert await round_trip(bus) == b"over tls"
        await bus.close()
        other_ca = make_ca(tmp_path / "other", "other-ca")
        stranger = make_cert(tmp_path / "other", other_ca, "decode-0", sans="DNS:decode-0")
        for cert in ({}, {"tls_cert": str(stranger.cert), "tls_key": str(stranger.key)}):
            with pytest.raises(Exception) as refused:  # noqa: PT011  (an ssl error or a closed socket)
                nc = await connect_once(server.settings(**cert))
                await nc.close()
            assert "Authorization Violation" not in str(refused.value), cert
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await connect_once(server.settings(password="wrong", **own))
    finally:
        stop_process(server.proc)


class Impostor:
    """A plaintext 'NATS' on a port: says INFO (auth required, no TLS) as nats-server
    does and records every byte a client sends it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.received = bytearray()
        self.clients = 0

    async def __aenter__(self) -> "Impostor":
        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.clients += 1
            writer.write(b'INFO {"server_id":"impostor","version":"2.9.10","auth_required":true,'
                         b'"max_payload":1048576}\r\n')
            await writer.drain()
            try:
                while data := await reader.read(4096):
                    self.received += data
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_client, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.asyncio
async def test_a_plaintext_impostor_never_gets_the_password(tmp_path):
    """With nats.tls_ca set, a server whose INFO does not ask for TLS gets nothing at all:
    not on the first connect (refused with an error at once), and not while the bus
    reconnects after its real NATS died and an impostor took the port; the bus goes on
    trying and is back on the real server once it returns. (nats-py alone would send its
    CONNECT, password included, in the clear.)"""
    server = TlsNats(tmp_path)
    port, password = server.port, server.user.password
    try:
        async with Impostor(free_port()) as first:
            settings = server.settings()
            settings.url = f"nats://127.0.0.1:{first.port}"
            with pytest.raises(ConnectionError, match="does not speak TLS"):
                await asyncio.wait_for(Bus.connect(settings, name="admin"), CONNECT_LIMIT_S)
            assert first.clients == 1 and bytes(first.received) == b"", bytes(first.received)
        bus = await asyncio.wait_for(Bus.connect(server.settings(), name="admin"), CONNECT_LIMIT_S)
        try:
            stop_process(server.proc)
            async with Impostor(port) as impostor:
                deadline = asyncio.get_running_loop().time() + 10
                while impostor.clients < 3:  # the bus reconnects every 0.5 s
                    assert asyncio.get_running_loop().time() < deadline, "the bus did not try the impostor"
                    await asyncio.sleep(0.1)
                assert password.encode() not in impostor.received and b"CONNECT" not in impostor.received
            server.proc = subprocess.Popen([find_nats_server(), "-c", str(tmp_path / "nats.conf"), "--tls", "--tlscert",
                                            str(tmp_path / "ca" / "nats.pem"), "--tlskey", str(tmp_path / "ca" / "nats.key")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_for_port(port, proc=server.proc)
            deadline = asyncio.get_running_loop().time() + 10
            while not bus.nc.is_connected:
                assert asyncio.get_running_loop().time() < deadline, "the bus did not come back to the real NATS"
                await asyncio.sleep(0.1)
            assert await round_trip(bus) == b"over tls"
        finally:
            await bus.close()
    finally:
        stop_process(server.proc)
