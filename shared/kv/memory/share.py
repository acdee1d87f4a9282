"""A KV cache another process on the same host can map, and the mapping of a peer's.

Direct prefill -> decode transfer copies blocks from the prefill engine's cache
into the decode engine's, with no stop in between:

- on a GPU by CUDA IPC: the cache tensors' memory handles (torch's own
  `_share_cuda_`), opened once per peer; a copy is then one device-to-device
  gather per cache tensor;
- on the CPU by shared memory: the cache is made in a file under /dev/shm that
  is unlinked at once and stays reachable as /proc/<pid>/fd/<fd> while the
  owner lives (nothing is left behind when it dies), and the peer maps it. The
  description carries the file's device and inode: a peer in another PID
  namespace (another container) whose /proc/<pid>/fd/<fd> names some other
  file refuses it, rather than reading a stranger's bytes as KV.
- across PID namespaces on one host (containers, pods), given a directory both
  see (`kv_share_dir`, a shared volume): the owner hands the cache's file
  descriptors over a unix socket there (fd_passing.py), to a peer that shows the
  description's secret. On the CPU those are the /dev/shm files'; on a GPU the
  cache is made with CUDA's virtual memory API and its POSIX-fd handles
  (cuda_vmm.py), which the driver imports in any namespace, where legacy CUDA
  IPC handles open only within one.

`describe` turns the cache into a small JSON description that travels in the
handoff; `open_peer` maps one. Nothing here is pickled: a description from the
network is data, checked before use.
"""

import base64
import logging
import json
import math
import os
import re
import uuid
from dataclasses import dataclass, field

import torch

from shared.kv.memory import cuda_vmm
from shared.kv.memory.fd_passing import FdServer, fetch_fds

log = logging.getLogger(__name__)
_PROC_FD = re.compile(r"^/proc/\d+/fd/\d+$")


@dataclass
class SharedMemoryAllocator:
    """Makes the cache tensors in shared memory (CPU); keeps their files open."""

    fds: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    identities: list[tuple[int, int]] = field(default_factory=list)
    """(st_dev, st_ino) of each file, which a peer checks before mapping it."""
    share_dir: str = ""
    """Where to hand the files' descriptors to peers in other PID namespaces ("": not)."""
    server: FdServer | None = None

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = cuda_vmm.tensor_bytes(shape, dtype)
        # The file is sparse: a /dev/shm too small for it would kill us (SIGBUS) at first touch.
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize < nbytes * 2:
            raise OSError(f"/dev/shm has room for less than twice the {nbytes} bytes of a KV cache tensor")
        path = f"/dev/shm/infermesh-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled
            tensor = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
        finally:
            os.unlink(path)  # reachable through the open fd only: gone with this process
        self.fds.append(fd)
        self.paths.append(f"/proc/{os.getpid()}/fd/{fd}")
        st = os.fstat(fd)
        self.identities.append((st.st_dev, st.st_ino))
        return tensor

    def serve(self) -> FdServer | None:
        if self.share_dir and self.server is None:
            self.server = FdServer(self.share_dir, self.fds, {"kind": "shm"})
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for fd in self.fds:
            os.close(fd)
        self.fds, self.paths, self.identities = [], [], []


@dataclass
class CudaVmmAllocator:
    """Makes the cache tensors (GPU) in memory of CUDA's virtual memory API whose
    handles are file descriptors, handed to peers through `share_dir`."""

    device: int
    share_dir: str
    mappings: list[cuda_vmm.Mapping] = field(default_factory=list)
    server: FdServer | None = None

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        mapping = cuda_vmm.allocate(cuda_vmm.tensor_bytes(shape, dtype), self.device)
        self.mappings.append(mapping)
        return cuda_vmm.as_tensor(mapping, tuple(shape), dtype, self.device).zero_()

    def serve(self) -> FdServer | None:
        if self.server is None:
            self.server = FdServer(self.share_dir, [m.fd for m in self.mappings], {"kind": "cuda_vmm"})
        return self.server

    def close(self) -> None:  # the memory goes with the last tensor over it
        if self.server is not None:
            self.server.close()
            self.server = None


Allocator = SharedMemoryAllocator | CudaVmmAllocator


def describe(tensors: list[torch.Tensor], allocator: Allocator | None, layout: str) -> bytes:
    """How a peer on this host opens these cache tensors (as data: JSON). Each tensor is
    a whole allocation (a file, a CUDA allocation) of its own shape (caches of several
    size classes differ)."""
    first = tensors[0]
    desc: dict = {
        "layout": layout, "shape": list(first.shape), "shapes": [list(t.shape) for t in tensors],
        "dtype": str(first.dtype).removeprefix("torch."),
    }  # fmt: skip
    try:
        server = allocator.serve() if allocator is not None else None
    except OSError as exc:  # an unwritable kv_share_dir: peers fall back (NIXL, kvcache), the handoff goes on
        log.warning("KV cache memory not offered over kv_share_dir: %s", exc)
        server = None
    if server is not None:
        desc.update(socket=server.path, secret=server.secret)
    if isinstance(allocator, CudaVmmAllocator):
        desc.update(kind="cuda_vmm", sizes=[m.nbytes for m in allocator.mappings])
    elif first.device.type == "cuda":
        storages = []
        for t in tensors:
            dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = t.untyped_storage()._share_cuda_()
            storages.append(
                {
                    "device": dev,
                    "handle": base64.b64encode(handle).decode(),
                    "size": size,
                    "offset": offset,
                    "ref_counter_handle": base64.b64encode(rc_handle).decode(),
                    "ref_counter_offset": rc_offset,
                    "event_handle": base64.b64encode(ev_handle).decode(),
                    "event_sync_required": ev_sync,
                }
            )
        desc.update(kind="cuda", storages=storages)
    elif allocator is not None:
        desc.update(kind="shm", paths=list(allocator.paths), files=[list(i) for i in allocator.identities])
    else:
        raise ValueError("a CPU cache is shared only when made by a SharedMemoryAllocator")
    return json.dumps(desc).encode()


def open_peer(data: bytes, device: torch.device) -> tuple[str, list[torch.Tensor]]:
    """The layout and the cache tensors a peer described; ValueError if this process
    cannot map them (another host, another device kind, a dead peer, bad data)."""
    try:
        desc = json.loads(data)
        if isinstance(desc, dict) and "ranks" in desc:
            return _open_ranks(desc, device)
        dtype = getattr(torch, desc["dtype"])
        count = len({"shm": desc.get("paths"), "cuda": desc.get("storages"), "cuda_vmm": desc.get("sizes")}[desc["kind"]])
        shapes = [tuple(int(n) for n in shape) for shape in desc.get("shapes", [desc["shape"]] * count)]
        kind = desc["kind"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"unreadable KV region description: {exc}") from None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {desc['dtype']!r}")
    if len(shapes) != count:
        raise ValueError(f"{len(shapes)} shapes for {count} KV tensors")
    if kind == "shm":
        if device.type != "cpu":
            raise ValueError("a shared-memory KV region maps into a CPU engine only")
        if desc.get("socket"):
            try:
                return desc["layout"], _open_handed(desc, shapes, dtype, device)
            except ValueError:
                pass  # no socket here: the files by their /proc paths (one PID namespace)
        tensors = []
        for path, identity, shape in zip(desc["paths"], desc.get("files", []), shapes):
            if not isinstance(path, str) or not _PROC_FD.match(path):
                raise ValueError(f"not a shared KV file: {path!r}")
            try:
                st = os.stat(path)
                if [st.st_dev, st.st_ino] != list(identity):
                    raise ValueError(f"{path} is another file here (another host or container?)")
                tensors.append(torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape))
            except (OSError, RuntimeError) as exc:
                raise ValueError(f"cannot map {path}: {exc}") from None
        if len(tensors) != len(desc["paths"]):
            raise ValueError("a shared KV file without its identity")
        return desc["layout"], tensors
    if kind == "cuda_vmm":
        if device.type != "cuda":
            raise ValueError("a CUDA KV region maps into a CUDA engine only")
        return desc["layout"], _open_handed(desc, shapes, dtype, device)
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError("a CUDA KV region maps into a CUDA engine only")
        torch.cuda.init()  # opening an IPC handle without a CUDA context crashes the process
        tensors = []
        for s, shape in zip(desc["storages"], shapes):
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    int(s["device"]),
                    base64.b64decode(s["handle"]),
                    int(s["size"]),
                    int(s["offset"]),
                    base64.b64decode(s["ref_counter_handle"]),
                    int(s["ref_counter_offset"]),
                    base64.b64decode(s["event_handle"]),
                    bool(s["event_sync_required"]),
                )
            except (RuntimeError, KeyError, ValueError) as exc:
                raise ValueError(f"cannot open the peer's CUDA memory: {exc}") from None
            tensors.append(torch.empty(0, dtype=dtype, device=f"cuda:{int(s['device'])}").set_(storage, 0, shape))
        return desc["layout"], tensors
    raise ValueError(f"unknown KV region kind {kind!r}")


def _open_ranks(desc: dict, device: torch.device) -> tuple[str, list[torch.Tensor]]:
    """A multi-rank instance's cache (shared/kv/memory/ranked_region.py): every rank's
    tensors, rank after rank, under the description's layout (which names the split)."""
    ranks = desc["ranks"]
    if not isinstance(ranks, list) or not ranks or not isinstance(desc["layout"], str):
        raise ValueError("unreadable multi-rank KV region description")
    tensors: list[torch.Tensor] = []
    for rank in ranks:
        tensors += open_peer(json.dumps(rank).encode(), device)[1]
    return desc["layout"], tensors


def _open_handed(desc: dict, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The cache tensors from the descriptors its owner hands over its socket."""
    path, secret = desc.get("socket"), desc.get("secret")
    if not isinstance(path, str) or not isinstance(secret, str) or not os.path.isabs(path):
        raise ValueError("no socket to ask the KV cache's owner for its memory")
    try:
        header, fds = fetch_fds(path, secret, len(shapes))
    except OSError as exc:
        raise ValueError(f"cannot reach the KV cache's owner at {path}: {exc}") from None
    try:
        if header.get("kind") != desc["kind"]:
            raise ValueError(f"the owner at {path} hands {header.get('kind')!r} memory, not {desc['kind']!r}")
        if desc["kind"] == "shm":
            tensors = []
            for fd, shape in zip(fds, shapes):
                try:
                    if os.fstat(fd).st_size < cuda_vmm.tensor_bytes(shape, dtype):
                        raise ValueError(f"the owner's KV file is smaller than {shape}")
                    size = math.prod(shape)
                    tensors.append(torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=dtype).view(shape))
                except (OSError, RuntimeError) as exc:
                    raise ValueError(f"cannot map the owner's KV file: {exc}") from None
            return tensors
        index = device.index if device.index is not None else torch.cuda.current_device()
        tensors = []
        for fd, nbytes, shape in zip(fds, desc["sizes"], shapes):
            try:
                mapping = cuda_vmm.import_fd(fd, int(nbytes), index)
                tensors.append(cuda_vmm.as_tensor(mapping, shape, dtype, index))
            except (OSError, RuntimeError) as exc:
                raise ValueError(f"cannot map the owner's CUDA memory: {exc}") from None
        return tensors
    finally:
        for fd in fds:
            os.close(fd)
