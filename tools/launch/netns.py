"""Hosts on one machine: network namespaces on a bridge, for tests and benchmarks
that must see the mesh as deployed (prefill, decode and kvcache on hosts of
their own, so no shared memory, no /proc of a peer, only the network).

    with Hosts(["kvcache", "prefill", "decode"]) as hosts:
        hosts.address("prefill")                  # its own address on the bridge
        hosts.command("prefill", [python, "-m", ...])   # run there, in a PID namespace of its own

Each namespace gets a veth pair to a bridge in the root namespace, one address
of a private /24 (10.231.N.0/24, N from the process id, so parallel test workers
never share one) and its loopback; the root namespace holds the bridge's
address (`gateway`), where nats-server and the balancer listen. Everything is
removed on exit, even after a failure. Needs root and iproute2.
"""

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, names: Sequence[str], subnet: int | None = None) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise HostsUnavailable("network namespaces need root, iproute2 and util-linux's unshare")
        self.names = list(names)
        self.subnet = subnet if subnet is not None else 1 + os.getpid() % 250
        tag = uuid.uuid4().hex[:5]
        self._bridge = f"imbr{tag}"
        self._namespaces = {name: f"im-{tag}-{name}" for name in self.names}
        self._veths = {name: f"imv{tag}{i}" for i, name in enumerate(self.names)}

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (nats-server, the balancer, the test)."""
        return f"10.231.{self.subnet}.1"

    def address(self, name: str) -> str:
        return f"10.231.{self.subnet}.{10 + self.names.index(name)}"

    def namespace(self, name: str) -> str:
        return self._namespaces[name]

    def command(self, name: str, argv: Sequence[str], pid_namespace: bool = True) -> list[str]:
        """argv run in host `name`'s network namespace (and a PID namespace of its own)."""
        prefix = ["ip", "netns", "exec", self._namespaces[name]]
        if pid_namespace:
            prefix += ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        return prefix + list(argv)

    def __enter__(self) -> "Hosts":
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            for name in self.names:
                ns, veth = self._namespaces[name], self._veths[name]
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", ns)
                _ip("link", "set", veth, "master", self._bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        except subprocess.CalledProcessError as exc:
            self.__exit__(None, None, None)
            raise HostsUnavailable(f"ip {' '.join(exc.cmd[1:])}: {exc.stderr.strip()}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "delete", self._namespaces[name]], capture_output=True)
            subprocess.run(["ip", "link", "delete", self._veths[name]], capture_output=True)
        subprocess.run(["ip", "link", "delete", self._bridge], capture_output=True)
