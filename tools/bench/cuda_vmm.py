"""Device memory made with CUDA's virtual memory API (cuMemCreate) and a shareable handle
type of our choice, as a torch tensor: the probe for moving KV between PID namespaces.

UCX's cuda_ipc refuses a peer in another PID namespace with legacy CUDA IPC handles
(cudaIpcGetMemHandle, what torch's caching allocator memory gets); it accepts one whose
memory was created with FABRIC handles. This module allocates such memory and, run as a
program, reports what the device and driver allow:

    PYTHONPATH=$PWD python3 -m tools.bench.cuda_vmm          # one JSON line
"""

from __future__ import annotations

import ctypes
import json
import sys
from dataclasses import dataclass

HANDLE_POSIX_FD = 0x1
HANDLE_FABRIC = 0x8
_ATTR_VMM = 102
_ATTR_POSIX_FD = 103
_ATTR_FABRIC = 128


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    pass


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise CudaError(f"{what}: {code} {name.value.decode() if name.value else ''}")


@dataclass
class VmmAllocation:
    """One cuMemCreate'd, mapped range; keep it alive as long as any tensor views it."""

    pointer: int
    nbytes: int
    handle: int
    handle_types: int

    def __del__(self) -> None:  # unmap and free; the process's exit does it too
        try:
            lib = _driver()
            lib.cuMemUnmap(ctypes.c_uint64(self.pointer), ctypes.c_size_t(self.nbytes))
            lib.cuMemRelease(ctypes.c_uint64(self.handle))
            lib.cuMemAddressFree(ctypes.c_uint64(self.pointer), ctypes.c_size_t(self.nbytes))
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def allocate(nbytes: int, device: int = 0, handle_types: int = HANDLE_FABRIC) -> VmmAllocation:
    import torch

    torch.zeros(1, device=f"cuda:{device}")  # the primary context, current on this thread
    lib = _driver()
    prop = _Prop(type=1, requestedHandleTypes=handle_types, location=_Location(type=1, id=device))
    gran = ctypes.c_size_t()
    _check(lib, lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
    size = -(-nbytes // gran.value) * gran.value
    handle = ctypes.c_uint64()
    _check(lib, lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)),
           "cuMemCreate")
    ptr = ctypes.c_uint64()
    _check(lib, lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                        ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    _check(lib, lib.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0)), "cuMemMap")
    access = _AccessDesc(location=_Location(type=1, id=device), flags=3)
    _check(lib, lib.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)),
           "cuMemSetAccess")
    return VmmAllocation(ptr.value, size, handle.value, handle_types)


def empty(shape: tuple[int, ...], dtype, device: int = 0, handle_types: int = HANDLE_FABRIC):  # noqa: ANN001, ANN201
    """A tensor over fresh VMM memory (contents undefined); the allocation rides on the tensor."""
    import torch

    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    alloc = allocate(nbytes, device, handle_types)

    class _Interface:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (alloc.pointer, False),
                                    "version": 3}

    raw = torch.as_tensor(_Interface(), device=f"cuda:{device}")
    tensor = raw.view(dtype).view(shape)
    tensor._vmm_allocation = alloc  # type: ignore[attr-defined]  # the mapping lives as long as the tensor
    return tensor


def probe(device: int = 0) -> dict:
    lib = _driver()
    _check(lib, lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    report: dict = {}
    for name, attr in (("vmm", _ATTR_VMM), ("posix_fd", _ATTR_POSIX_FD), ("fabric", _ATTR_FABRIC)):
        value = ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev)
        report[f"attr_{name}"] = value.value
    for name, types in (("fabric", HANDLE_FABRIC), ("posix_fd", HANDLE_POSIX_FD)):
        try:
            alloc = allocate(64 << 20, device, types)
            report[f"create_{name}"] = "ok"
            if types == HANDLE_FABRIC:
                buf = (ctypes.c_ubyte * 64)()
                code = lib.cuMemExportToShareableHandle(buf, ctypes.c_uint64(alloc.handle), HANDLE_FABRIC,
                                                        ctypes.c_uint64(0))
                report["export_fabric"] = "ok" if code == 0 else f"error {code}"
        except CudaError as exc:
            report[f"create_{name}"] = str(exc)
    return report


if __name__ == "__main__":
    print(json.dumps(probe(int(sys.argv[1]) if len(sys.argv) > 1 else 0)), flush=True)
