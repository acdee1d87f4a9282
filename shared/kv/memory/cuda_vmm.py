"""GPU memory that another process can map from another PID namespace: CUDA's virtual
memory API (cuMemCreate) with POSIX file-descriptor handles, through the driver (ctypes).

torch's allocator memory is shared by legacy CUDA IPC handles, which the driver opens
only inside one PID namespace (the container's), and UCX's cuda_ipc refuses such peers
too; FABRIC handles cross namespaces but need an IMEX channel that containers are not
given (cuMemCreate answers CUDA_ERROR_NOT_PERMITTED: docs/perf/gpu_tests_fabric_probe_
h100_2026-12-06.txt). A POSIX-fd handle is a file descriptor: passed over a unix socket
(fd_passing.py) it reaches a process in any namespace that can open the socket, which
imports it and maps the same memory into its own address space. share.py uses both.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

HANDLE_POSIX_FD = 0x1
HANDLE_FABRIC = 0x8
_LOCATION_DEVICE = 1
_ALLOCATION_PINNED = 1
_ACCESS_READ_WRITE = 3


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


class CudaDriverError(OSError):
    """The driver refused (its error name in the message)."""


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"no CUDA driver: {exc}") from None


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise CudaDriverError(f"{what}: {name.value.decode() if name.value else code}")


@dataclass
class Mapping:
    """A physical allocation mapped at [pointer, pointer + nbytes) in this process.
    Unmapped when the last tensor over it goes (as_tensor's storage holds it)."""

    pointer: int
    nbytes: int
    handle: int
    fd: int = -1
    """The exported handle (owner only): what a peer receives."""

    def __del__(self) -> None:
        try:
            lib = _driver()
            lib.cuMemUnmap(ctypes.c_uint64(self.pointer), ctypes.c_size_t(self.nbytes))
            lib.cuMemAddressFree(ctypes.c_uint64(self.pointer), ctypes.c_size_t(self.nbytes))
            lib.cuMemRelease(ctypes.c_uint64(self.handle))
            if self.fd >= 0:
                os.close(self.fd)
        except Exception:  # noqa: BLE001 - at interpreter exit the process's end frees it anyway
            pass


def _map(lib: ctypes.CDLL, handle: int, nbytes: int, device: int) -> int:
    """Map the allocation `handle` on `device`; released (not leaked) when mapping fails."""
    try:
        return _reserve_and_map(lib, handle, nbytes, device)
    except CudaDriverError:
        lib.cuMemRelease(ctypes.c_uint64(handle))
        raise


def _reserve_and_map(lib: ctypes.CDLL, handle: int, nbytes: int, device: int) -> int:
    ptr = ctypes.c_uint64()
    _check(lib, lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                                        ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")  # fmt: skip
    try:
        _check(lib, lib.cuMemMap(ptr, ctypes.c_size_t(nbytes), ctypes.c_size_t(0), ctypes.c_uint64(handle),
                                 ctypes.c_uint64(0)), "cuMemMap")  # fmt: skip
        access = _AccessDesc(location=_Location(type=_LOCATION_DEVICE, id=device), flags=_ACCESS_READ_WRITE)
        _check(lib, lib.cuMemSetAccess(ptr, ctypes.c_size_t(nbytes), ctypes.byref(access), ctypes.c_size_t(1)),
               "cuMemSetAccess")  # fmt: skip
    except CudaDriverError:
        lib.cuMemUnmap(ptr, ctypes.c_size_t(nbytes))
        lib.cuMemAddressFree(ptr, ctypes.c_size_t(nbytes))
        raise
    return ptr.value


def _context(device: int) -> ctypes.CDLL:
    torch.cuda.init()
    torch.zeros(1, device=f"cuda:{device}")  # the device's primary context, current on this thread
    return _driver()


def allocate(nbytes: int, device: int, handle_types: int = HANDLE_POSIX_FD) -> Mapping:
    """Fresh device memory (contents undefined) whose handle can be exported."""
    lib = _context(device)
    prop = _Prop(type=_ALLOCATION_PINNED, requestedHandleTypes=handle_types,
                 location=_Location(type=_LOCATION_DEVICE, id=device))  # fmt: skip
    granularity = ctypes.c_size_t()
    _check(lib, lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0), "granularity")
    size = -(-max(nbytes, 1) // granularity.value) * granularity.value
    handle = ctypes.c_uint64()
    _check(lib, lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)),
           "cuMemCreate")  # fmt: skip
    mapping = Mapping(_map(lib, handle.value, size, device), size, handle.value)
    if handle_types & HANDLE_POSIX_FD:
        fd = ctypes.c_int(-1)
        _check(lib, lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(handle.value),
                                                     HANDLE_POSIX_FD, ctypes.c_uint64(0)), "export")  # fmt: skip
        mapping.fd = fd.value
    return mapping


def import_fd(fd: int, nbytes: int, device: int) -> Mapping:
    """Map a peer's exported allocation (its POSIX-fd handle, received) on our device.
    The fd is ours to close afterwards; the mapping holds the memory."""
    lib = _context(device)
    handle = ctypes.c_uint64()
    _check(lib, lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_POSIX_FD),
           "cuMemImportFromShareableHandle")  # fmt: skip
    return Mapping(_map(lib, handle.value, nbytes, device), nbytes, handle.value)


class _ArrayInterface:
    """CUDA's array interface over a mapping: torch wraps the pointer without a copy and
    holds this object until the storage goes, so the mapping lives exactly as long as any
    tensor or view over it (a Python attribute on one tensor would not: views lack it)."""

    def __init__(self, mapping: Mapping, nbytes: int) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (mapping.pointer, False),
                                         "version": 3}


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of `shape` and `dtype`."""
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def as_tensor(mapping: Mapping, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
    """The mapping's first bytes as a tensor of `shape`; its storage keeps the mapping alive."""
    nbytes = tensor_bytes(shape, dtype)
    if nbytes > mapping.nbytes:
        raise ValueError(f"a tensor of {nbytes} bytes over a mapping of {mapping.nbytes}")
    raw = torch.as_tensor(_ArrayInterface(mapping, nbytes), device=f"cuda:{device}")
    return raw.view(dtype).view(shape)
