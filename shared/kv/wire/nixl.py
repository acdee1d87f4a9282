"""One NIXL agent per process: the transfer engine that moves KV between
processes that cannot map each other's memory (another container, pod or node).

NIXL (NVIDIA's transfer library behind vLLM's NixlConnector, Dynamo and llm-d)
runs UCX underneath: shared memory or CUDA IPC within a node, RDMA or TCP
between nodes, chosen by UCX from its environment (UCX_TLS, UCX_NET_DEVICES).
A process registers the memory peers may reach once (the KV cache, a landing
buffer); a peer that moves bytes to or from it adds this agent's metadata once
(it travels over NATS or gRPC, and is cached here by agent name) and then READs
or WRITEs lists of (address, length) descriptors in one transfer. A transfer may
name a notification that the other side receives once the bytes have moved:
that is how a lease ends. NIXL itself refuses a descriptor outside the memory
the other side registered and described in its metadata (`metadata(only)`
describes only some regions: a peer given that can reach nothing else).

Torch-free: memory is (address, bytes, device) triples; descriptor lists are
numpy arrays, so a transfer of thousands of block runs costs no Python loop
over NIXL objects. The wrapper is thread-safe: every call into the agent holds
one lock (the agent runs in NIXL's sync mode NONE, which leaves that to the
caller), briefly, never while a transfer is waited for; so the KV connector's
copy thread, the engine thread that polls notifications, the kvcache client's
thread and the kvcache service's writer threads may share one agent.
"""

import importlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TOKEN_BYTES = 16

class NixlUnavailable(RuntimeError):
    """NIXL is not installed here or its backend would not start."""


class NixlTransferError(RuntimeError):
    """A transfer failed, or did not finish in time (the peer died or went away)."""


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    address: int
    nbytes: int
    device: int
    """The GPU's index for VRAM; 0 for host memory."""


@dataclass(frozen=True, slots=True)
class Registration:
    """Regions registered together (`NixlAgent.register`), to describe or deregister."""

    regions: tuple[MemoryRegion, ...]
    memory: str
    handle: object


def agent_name(instance_id: str) -> str:
    """A name unique to this process's life: a restarted peer has a new one, so a
    reader's cached metadata for the old one is never used for the new."""
    return f"{instance_id}-{uuid.uuid4().hex[:12]}"


PROGRESS_DELAY_US = 1000
"""How long NIXL's progress thread sleeps between rounds. The Python wrapper hard-codes
0, a thread that spins: two idle agents took 0.63 of a core on the 2-core CI machine,
against 0.04 at 1 ms, and a 64 MiB read over TCP ran 3x faster at 1 ms (the spinning
threads had taken the cores). A reader polls its own transfers; the thread matters for
the side being read over TCP, which a millisecond does not hold up."""


UCX_TCP_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
    "UCX_TCP_SNDBUF": "8m",
    "UCX_TCP_RCVBUF": "8m",
}
"""UCX's TCP transport for KV blocks: segments of 2 MiB, not UCX's 8 KiB default, and
socket buffers to match. Between two network namespaces on the 2-core CPU machine an
8k-token read ran 1.4-1.8 GB/s with them against 0.4-0.8 without (tools/bench/nixl_bench.py).
UCX reads its configuration only from the environment, when the first agent starts; a
value the deployment sets wins."""


UCX_CUDA_DEFAULTS = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
    "UCX_CUDA_IPC_MAX_POLL": "1024",
    "UCX_CUDA_COPY_MAX_POLL": "1024",
}
"""UCX's CUDA IPC for KV reads. A decode READs prefill's blocks (a get), and UCX's
cuda_ipc turns gets off ("auto") where nvml finds no NVLink: on a one-GPU H200 box the
read then fell to a software emulation over tcp/lo at 1.6-3 GB/s
(docs/perf/nixl_gpu_h200_2026-12-05.txt). A get within one GPU is a device copy, as
fast as a put. And the CUDA transports complete at most MAX_POLL copies per progress
call (16 by default) where a KV read is thousands of copies (a descriptor per run of
blocks, per layer and k/v plane).
UCX's cuda_ipc reaches only a peer in this process's PID namespace (legacy CUDA IPC
handles cannot cross one; fabric handles can): between containers with PID namespaces
of their own UCX falls back to TCP (docs/perf/nixl_gpu_h100_pidns_2026-12-06.txt)."""

READ_POLL_CAP_S = {"VRAM": 20e-6, "DRAM": 1e-3}
"""The longest pause between a reader's polls of its transfer, by its memory. Between
GPUs (CUDA IPC, RDMA) a poll completes copies: the pause is the transfer's pace, so
the copy thread polls hard (it is not the engine's thread). Host memory over TCP is
moved by the peer's progress thread too; polling hard there only takes the cores
that thread needs."""


def nixl_api() -> Any:
    """NIXL's Python API from the wheel built for this process's CUDA: nixl-cu12 (the
    project's pin; its UCX needs libcudart 12 for GPU memory) or nixl-cu13 (a CUDA 13
    torch), as NVIDIA's `nixl` meta package picks, without needing both installed.
    Torch is not imported here: only asked, when the caller has imported it."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    order = ["nixl_cu13", "nixl_cu12"]
    if cuda and cuda.split(".")[0] == "12":
        order.reverse()
    for name in order:
        try:
            return importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (name, f"{name}._api"):
                raise
    raise NixlUnavailable("no NIXL wheel is installed (nixl-cu12 or nixl-cu13)")


def _make_agent(name: str, backends: Sequence[str], progress_delay_us: int) -> Any:
    """nixl_agent with a progress thread that sleeps progress_delay_us between rounds:
    the wrapper is built without backends or thread, its core agent then replaced by
    one configured here, and the backends created on that one."""
    _api = nixl_api()

    agent = _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = _api.nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = _api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.pthrDelay = progress_delay_us
    config.captureTelemetry = False
    agent.agent = _api.nixlBind.nixlAgent(name, config)
    for backend in backends:
        agent.create_backend(backend, {})
    return agent


class NixlAgent:
    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        progress_delay_us: int = PROGRESS_DELAY_US,
        loopback_only: bool = False,
    ) -> None:
        """loopback_only: UCX's TCP listens on the loopback device alone (closed by default:
        a worker bound to loopback opens nothing beyond it); a UCX_NET_DEVICES the
        deployment sets wins."""
        logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per backend otherwise
        for key, value in {**UCX_TCP_DEFAULTS, **UCX_CUDA_DEFAULTS}.items():
            os.environ.setdefault(key, value)
        if loopback_only:
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        try:
            self._agent = _make_agent(name, backends, progress_delay_us)
        except NixlUnavailable:
            raise
        except Exception as exc:
            raise NixlUnavailable(f"NIXL agent with backends {list(backends)} did not start: {exc}") from None
        self.name = name
        self.backends = tuple(backends)
        self.token = os.urandom(TOKEN_BYTES)
        """A secret of this agent's owner, for a service that must know a request naming
        this agent comes from its owner (kvcache binds it to the agent's name)."""
        self._calls = threading.Lock()
        """Held around every call into the agent."""
        self._peers_lock = threading.Lock()
        self._peers: set[str] = set()
        """Agents whose metadata was added."""
        self._registered: list[Registration] = []

    def register(self, regions: Sequence[MemoryRegion], memory: str) -> Registration:
        """Let peers reach these regions (memory: "DRAM" or "VRAM")."""
        descs = [(r.address, r.nbytes, r.device, "") for r in regions]
        with self._calls:
            registration = Registration(tuple(regions), memory, self._agent.register_memory(descs, memory))
        self._registered.append(registration)
        return registration

    def deregister(self, registration: Registration) -> None:
        """Peers can no longer start transfers to or from these regions (once they
        add this agent's metadata anew)."""
        if registration in self._registered:
            self._registered.remove(registration)
            self._deregister(registration)

    def metadata(self, only: Registration | None = None) -> bytes:
        """What a peer adds to reach this agent (fetched once per peer and cached): all
        it registered, or `only` those regions (the peer can then reach nothing else)."""
        with self._calls:
            if only is None:
                return self._agent.get_agent_metadata()
            descs = self._agent.get_reg_descs([(r.address, r.nbytes, r.device, "") for r in only.regions],
                                              only.memory)  # fmt: skip
            return self._agent.get_partial_agent_metadata(descs, True, list(self.backends))

    def ensure_peer(self, name: str, fetch: Callable[[], bytes]) -> None:
        """Make `name` reachable: add its metadata (from fetch()) unless added already.
        ValueError when the metadata names another agent (the peer restarted)."""
        with self._peers_lock:
            if name in self._peers:
                return
        metadata = fetch()
        with self._peers_lock:
            if name in self._peers:
                return
        self.add_peer(name, metadata)

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Add (or update: a peer that registered more memory) `name`'s metadata.
        ValueError when the metadata names another agent; nothing is kept then."""
        with self._calls:
            added = self._agent.add_remote_agent(metadata)
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                if added not in self._peers:
                    self._agent.remove_remote_agent(added)
                raise ValueError(f"the peer's agent is {added!r} now, not {name!r}: it restarted")
        with self._peers_lock:
            self._peers.add(name)

    def forget_peer(self, name: str) -> None:
        """Drop a peer's metadata (after a failed transfer: it may have restarted)."""
        with self._peers_lock:
            if name not in self._peers:
                return
            self._peers.discard(name)
        try:
            with self._calls:
                self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone on NIXL's side
            log.debug("removing NIXL peer %s: %s", name, exc)

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        memory: str,
        remote_memory: str,
        notification: bytes,
        timeout_s: float,
        poll_cap_s: float | None = None,
    ) -> int:
        """Read remote descriptors (an [n, 3] array of address, bytes, device) of `peer`
        into local ones, in one transfer; the peer is told `notification` once the
        bytes have arrived. Blocks until done; the bytes moved. NixlTransferError when
        the transfer fails or is not done within timeout_s. poll_cap_s: the longest
        pause between polls (READ_POLL_CAP_S by memory unless given)."""
        return self._transfer("READ", peer, local, remote, memory, remote_memory, notification, timeout_s,
                              poll_cap_s)  # fmt: skip

    def write(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        memory: str,
        remote_memory: str,
        timeout_s: float,
        notification: bytes = b"",
        poll_cap_s: float | None = None,
    ) -> int:
        """Write local descriptors into remote ones of `peer` (both [n, 3] arrays of
        address, bytes, device), in one transfer; as read() otherwise."""
        return self._transfer("WRITE", peer, local, remote, memory, remote_memory, notification, timeout_s,
                              poll_cap_s)  # fmt: skip

    def _transfer(
        self, op: str, peer: str, local: np.ndarray, remote: np.ndarray, memory: str, remote_memory: str,
        notification: bytes, timeout_s: float, poll_cap_s: float | None,
    ) -> int:  # fmt: skip
        if local.shape != remote.shape or not len(local):
            raise ValueError(f"descriptor lists differ or are empty: {local.shape} vs {remote.shape}")
        what = "read from" if op == "READ" else "write to"
        with self._calls:
            local_descs = self._agent.get_xfer_descs(np.ascontiguousarray(local, dtype=np.uint64), memory)
            remote_descs = self._agent.get_xfer_descs(np.ascontiguousarray(remote, dtype=np.uint64), remote_memory)
            try:
                handle = self._agent.initialize_xfer(op, local_descs, remote_descs, peer, notification)
            except Exception as exc:
                raise NixlTransferError(f"NIXL could not start a {what} {peer}: {exc}") from None
        try:
            with self._calls:
                state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            pause, cap = 0.0, poll_cap_s if poll_cap_s is not None else READ_POLL_CAP_S.get(memory, 1e-3)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise NixlTransferError(f"the {what} {peer} was not done within {timeout_s:.1f}s")
                # Spin briefly (a GPU-to-GPU transfer is done in microseconds), then back off.
                if pause:
                    time.sleep(pause)
                pause = min(pause * 2 or 1e-6, cap)
                with self._calls:
                    state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise NixlTransferError(f"the {what} {peer} failed")
        finally:
            try:
                with self._calls:
                    self._agent.release_xfer_handle(handle)
            except Exception as exc:  # a handle of a failed transfer may refuse to go
                log.debug("releasing a NIXL transfer handle: %s", exc)
        return int(local[:, 1].sum())

    def take_notifications(self) -> list[bytes]:
        """Notifications that arrived since the last call, from every peer."""
        with self._calls:
            notifs = self._agent.get_new_notifs()
        return [n for messages in notifs.values() for n in messages]

    def close(self) -> None:
        for registration in self._registered:
            self._deregister(registration)
        self._registered.clear()

    def _deregister(self, registration: Registration) -> None:
        try:
            with self._calls:
                self._agent.deregister_memory(registration.handle)
        except Exception as exc:
            log.debug("deregistering NIXL memory: %s", exc)
