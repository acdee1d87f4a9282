"""Hosts of a multi-host mesh on one machine, for the tests and benchmarks that must
see the mesh as deployed (kvcache, prefill and decode on hosts of their own: no shared
memory, no /proc of a peer, only the network): network namespaces, each joined to a
Linux bridge in the root namespace by a veth pair, on a private /24 of 10.231.0.0/16
of this process's own; and a command that runs a service in one of them with a PID
namespace (and /proc) of its own, as a container runs it
(`ip netns exec NS unshare -p -f --mount-proc ...`).

    with namespaces(["kvcache", "prefill-0", "decode-0"]) as lab:
        lab.gateway                      # the bridge's address (root namespace)
        lab["prefill-0"].address         # prefill-0's address on the bridge
        lab.command("prefill-0", argv)   # argv run there

Each namespace sees loopback and one interface, `eth0`, with its address; the
bridge carries TCP between all of them and the root namespace. Everything made
is removed on exit (the processes left in the namespaces killed first), also after
a failure. Needs root, `ip netns` and `unshare`; without them namespaces() raises
HostsUnavailable, which says why (a test skips on it).

The /24 is 10.231.<n>.0 with n derived from this process's id and claimed by
creating the bridge imbr<n> (atomic: a second creator fails and tries the next
n), so parallel test workers never share one. The bridge's alias names its
owner's pid: a bridge left by a process that is gone (killed with SIGKILL) is
removed, with its namespaces, when its slot is wanted again.

Run as a script (python netns.py NS ARGV...), this file is that command's outer
process: it starts ARGV in the namespace and forwards SIGTERM and SIGINT to it.
`unshare` cannot be that process: it blocks both signals while it waits for its
child (util-linux 2.38), so a service under it would never hear SIGTERM and
never drain. The chain dies with its starter: this process is killed with its
parent where the starter asks for it (up.py's PR_SET_PDEATHSIG wrapper), unshare
with this process, the service with unshare (--kill-child)."""

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SUBNET_PREFIX = "10.231"
"""The /16 the namespaces' /24s are taken from: the project's own, used on no real network here."""
ALIAS = "infermesh-test pid="
"""The start of a bridge's alias (ip link ... alias): whose bridge it is."""
INNER_DEVICE = "eth0"
"""The interface each namespace sees, as in a container (UCX_NET_DEVICES can name it)."""
FIRST_HOST = 10
"""Namespace i gets 10.231.<n>.<FIRST_HOST + i>; the bridge has .1."""


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip netns` or `unshare`, refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` here"
    if _ip("netns", "list", check=False).returncode != 0:
        return "`ip netns` is not available"
    return None


@dataclass(frozen=True)
class Namespace:
    """One host of the lab."""

    name: str
    """The `ip netns` name: im<n>-<label>."""
    label: str
    """What the test calls it (a service name: kvcache, prefill-0, ...)."""
    address: str
    """Its address on the bridge."""
    veth: str
    """The root namespace's end of its veth pair (on the bridge)."""


@dataclass
class Lab:
    """The bridge, its /24 and the namespaces on it."""

    slot: int
    """n of 10.231.<n>.0/24."""
    bridge: str
    gateway: str
    """The bridge's address: where the root namespace's services listen for the namespaces."""
    hosts: dict[str, Namespace] = field(default_factory=dict)

    def __getitem__(self, label: str) -> Namespace:
        return self.hosts[label]

    def command(self, label: str, argv: list[str]) -> list[str]:
        """argv run in namespace `label` with a PID namespace of its own, behind a
        process that forwards SIGTERM and SIGINT to it (the module's doc says why)."""
        return [sys.executable, str(Path(__file__).resolve()), self.hosts[label].name, *argv]

    def bytes_out(self, label: str) -> int:
        """Bytes namespace `label` has sent onto the bridge so far."""
        return int(Path(f"/sys/class/net/{self.hosts[label].veth}/statistics/rx_bytes").read_text())

    def limit_rate(self, label: str, rate: str | None) -> None:
        """What namespace `label` sends, at most `rate` (tc's token bucket, e.g. "8mbit"),
        as a slow link would; None lifts the limit."""
        netns = self.hosts[label].name
        if rate is None:
            subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", INNER_DEVICE, "root"],
                           capture_output=True)  # fmt: skip
            return
        subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", INNER_DEVICE, "root", "tbf",
                        "rate", rate, "burst", "32kb", "limit", "4mb"], check=True, capture_output=True)  # fmt: skip

    def pids(self, label: str) -> list[int]:
        """The processes in namespace `label`'s network namespace (ids as the root
        namespace sees them): unshare and the service under it."""
        out = _ip("netns", "pids", self.hosts[label].name, check=False).stdout
        return [int(p) for p in out.split()]

    def service_pid(self, label: str, timeout_s: float = 10.0) -> int:
        """The id (in the root namespace) of the process `command` started in `label`:
        the one whose PID namespace is not unshare's."""
        ours = os.readlink("/proc/self/ns/pid")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            outer, inner = set(), []
            for pid in self.pids(label):
                with contextlib.suppress(OSError):
                    (outer.add(pid) if os.readlink(f"/proc/{pid}/ns/pid") == ours else inner.append(pid))
            for pid in inner:  # the service is unshare's child; its own children are not
                with contextlib.suppress(OSError):
                    if _parent(pid) in outer:
                        return pid
            time.sleep(0.05)
        raise LookupError(f"no process runs in {label}'s PID namespace")


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise OSError(f"no PPid in /proc/{pid}/status")


def _owner_alive(alias: str) -> bool:
    try:
        pid = int(alias.removeprefix(ALIAS))
    except ValueError:
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim_slot() -> tuple[int, str]:
    """A /24 of our own: the first free n from one derived from our pid (1..254),
    claimed by creating its bridge; a bridge whose owner is gone is cleared first."""
    start = os.getpid() % 254
    for k in range(254):
        n = (start + k) % 254 + 1
        bridge = f"imbr{n}"
        made = _ip("link", "add", bridge, "type", "bridge", check=False)
        if made.returncode != 0:
            alias = _ip("-o", "link", "show", bridge, check=False).stdout.partition(" alias ")[2].strip()
            if alias.startswith(ALIAS) and not _owner_alive(alias):
                _remove(n, bridge)
                made = _ip("link", "add", bridge, "type", "bridge", check=False)
            if made.returncode != 0:
                continue
        if f" {SUBNET_PREFIX}.{n}." in _ip("-o", "-4", "addr", "show").stdout:  # someone else's network
            _ip("link", "del", bridge, check=False)
            continue
        _ip("link", "set", bridge, "alias", f"{ALIAS}{os.getpid()}")
        return n, bridge
    raise RuntimeError(f"no free /24 in {SUBNET_PREFIX}.0.0/16")


def _kill_all(netns: str) -> None:
    """SIGKILL every process in a namespace of ours (by id; unshare's --kill-child takes their children)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove(n: int, bridge: str) -> None:
    """Everything of slot n: its namespaces' processes, the namespaces, the veths, the bridge."""
    for netns in _ip("netns", "list", check=False).stdout.splitlines():
        name = netns.split()[0] if netns.strip() else ""
        if name.startswith(f"im{n}-"):
            _kill_all(name)
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        dev = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if dev.startswith(f"im{n}v"):
            _ip("link", "del", dev, check=False)
    _ip("link", "del", bridge, check=False)


@contextlib.contextmanager
def namespaces(labels: list[str]) -> Iterator[Lab]:
    """One network namespace per label on a bridge of this process's own (module doc);
    HostsUnavailable, saying why, where they cannot be made. Removed on exit."""
    why = unavailable()
    if why is not None:
        raise HostsUnavailable(why)
    try:
        n, bridge = _claim_slot()
    except RuntimeError as exc:
        raise HostsUnavailable(f"cannot make a bridge: {exc}") from None
    lab = Lab(n, bridge, f"{SUBNET_PREFIX}.{n}.1")
    try:
        try:
            _ip("addr", "add", f"{lab.gateway}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            for i, label in enumerate(labels):
                host = Namespace(f"im{n}-{label}", label, f"{SUBNET_PREFIX}.{n}.{FIRST_HOST + i}", f"im{n}v{i}")
                assert len(host.veth) <= 15 and len(bridge) <= 15
                _ip("netns", "add", host.name)
                lab.hosts[label] = host
                # The inner end is made in the namespace: every namespace's is eth0.
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", INNER_DEVICE, "netns", host.name)
                _ip("link", "set", host.veth, "master", bridge, "up")
                _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", INNER_DEVICE)
                _ip("-n", host.name, "link", "set", INNER_DEVICE, "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
            probe = subprocess.run(["ip", "netns", "exec", lab.hosts[labels[0]].name, "unshare", "-p", "-f",
                                    "--mount-proc", "true"], capture_output=True, text=True)  # fmt: skip
            if probe.returncode != 0:
                raise RuntimeError(f"unshare -p -f --mount-proc: {probe.stderr.strip()}")
        except RuntimeError as exc:
            raise HostsUnavailable(f"cannot make network namespaces here: {exc}") from None
        yield lab
    finally:
        _remove(n, bridge)


# -- the outer process of Lab.command ---------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _run_in(netns: str, argv: list[str]) -> int:
    def die_with_us() -> None:  # in the child, before exec (this process has one thread)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    inner = subprocess.Popen(
        ["ip", "netns", "exec", netns, "unshare", "-p", "-f", "--mount-proc", "--kill-child=SIGKILL", *argv],
        preexec_fn=die_with_us,
    )

    def forward(signum: int, frame: object) -> None:
        children = Path(f"/proc/{inner.pid}/task/{inner.pid}/children")
        with contextlib.suppress(OSError, ValueError):
            for pid in children.read_text().split():
                os.kill(int(pid), signum)
                return
        inner.kill()  # not forked yet: nothing to drain

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = inner.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(_run_in(sys.argv[1], sys.argv[2:]))
