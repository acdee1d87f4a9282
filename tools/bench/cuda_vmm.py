"""What the device and driver allow for KV shared across PID namespaces: the VMM, POSIX-fd
and FABRIC handle attributes, and whether cuMemCreate and export succeed with each
handle type (shared/kv/memory/cuda_vmm.py does the allocating).

    PYTHONPATH=$PWD python3 -m tools.bench.cuda_vmm [DEVICE]  # one JSON line
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

from shared.kv.memory import cuda_vmm
from tools.bench.raw_file import add_json_flag, write_rows

_ATTRIBUTES = {"vmm": 102, "posix_fd": 103, "fabric": 128}


def probe(device: int = 0) -> dict:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit(0)
    dev = ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), device)
    report: dict = {}
    for name, attr in _ATTRIBUTES.items():
        value = ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev)
        report[f"attr_{name}"] = value.value
    for name, types in (("fabric", cuda_vmm.HANDLE_FABRIC), ("posix_fd", cuda_vmm.HANDLE_POSIX_FD)):
        try:
            cuda_vmm.allocate(64 << 20, device, types)
            report[f"create_{name}"] = "ok"
        except cuda_vmm.CudaDriverError as exc:
            report[f"create_{name}"] = str(exc)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cuda_vmm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("device", type=int, nargs="?", default=0, help="the CUDA device's index")
    add_json_flag(p)
    args = p.parse_args(argv)
    report = probe(args.device)
    print(json.dumps(report), flush=True)
    write_rows(args.json, [report])
    return 0


if __name__ == "__main__":
    sys.exit(main())
