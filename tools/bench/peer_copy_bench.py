"""The direct prefill -> decode KV copy alone, between two processes on one GPU (CUDA
IPC) or on the CPU (shared memory): effective bandwidth of KVRegion.copy_from_peer
for a Llama-3-8B-shaped cache (32 layers, 8 kv heads of 128, bf16 on a GPU), for
1k and 8k-token prompts, blocks scattered as a busy pool scatters them. Both
caches are one allocation, as the engine makes them, so a copy is one gather and
one scatter over all layers.

    PYTHONPATH=$PWD python3 -m tools.bench.peer_copy_bench --log peer_copy.log   # on the GPU machine
    .venv/bin/python -m tools.bench.peer_copy_bench --device cpu --layers 4
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from shared.kv.memory.region import KVRegion
from shared.kv.memory.share import SharedMemoryAllocator, open_peer
from shared.kv.spec import kv_cache_layout
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows

CHILD = """
import json, sys, torch
from shared.kv.memory.region import KVRegion
from shared.kv.memory.share import SharedMemoryAllocator
from shared.kv.spec import kv_cache_layout
from shared.kv.memory.share import CudaVmmAllocator
layers, blocks, device, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], getattr(torch, sys.argv[4])
share_dir = sys.argv[5]
layout = kv_cache_layout([None] * layers)
if device == "cpu":
    alloc = SharedMemoryAllocator(share_dir=share_dir)
else:
    alloc = CudaVmmAllocator(0, share_dir) if share_dir else None
shape = (layers, 2, blocks, 16, 8, 128)  # one allocation, as the engine makes its cache
stacked = alloc(shape, dtype) if alloc else torch.empty(shape, dtype=dtype, device=device)
stacked.normal_()
tensors = list(stacked.unbind(0))
region = KVRegion(tensors, layout, alloc)
print(json.dumps({"region": region.share().decode()}), flush=True)
sys.stdin.readline()
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=2048, help="blocks of 16 tokens in each cache")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pid-namespace", action="store_true",
                   help="the cache's owner in a PID namespace of its own (a container): its memory handed over a "
                        "unix socket (kv_share_dir; on a GPU made by CUDA's VMM API), as between containers")
    p.add_argument("--log", default=None, metavar="PATH",
                   help="the raw file: what is printed, under tools/bench/raw_file.py's header")
    add_json_flag(p)
    args = p.parse_args(argv)
    with tee_stdout(args.log):
        rows = _bench(args)
    write_rows(args.json, rows, device=args.device, layers=args.layers, pid_namespace=args.pid_namespace)


def _bench(args: argparse.Namespace) -> list[dict]:
    """The copies' figures, one row per prompt length."""
    rows = []
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    share_dir = tempfile.mkdtemp(prefix="infermesh-kv-share-") if args.pid_namespace else ""
    argv = [sys.executable, "-c", CHILD, str(args.layers), str(args.blocks), args.device, dtype, share_dir]
    if args.pid_namespace:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]
    child = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        description = json.loads(child.stdout.readline())["region"].encode()
        device = torch.device(args.device)
        _, peer = open_peer(description, device)
        layout = kv_cache_layout([None] * args.layers)
        alloc = SharedMemoryAllocator() if args.device == "cpu" else None
        shape = (args.layers, 2, args.blocks, 16, 8, 128)
        mine = list(torch.zeros(shape, dtype=getattr(torch, dtype), device=device).unbind(0))
        region = KVRegion(mine, layout, alloc)
        g = torch.Generator().manual_seed(0)
        kind = json.loads(description)["kind"]
        print(f"{args.device}, {args.layers} layers, {dtype}, owner in {'its own' if args.pid_namespace else 'our'} "
              f"PID namespace, memory shared as {kind}: block = {region.block_bytes / 1e6:.2f} MB across layers")
        for tokens in (1024, 8192):
            n = min(tokens // 16, args.blocks)  # a tiny cache (--blocks) holds fewer: count what is copied
            tokens = n * 16
            src = torch.randperm(args.blocks, generator=g)[:n].tolist()
            dst = torch.randperm(args.blocks, generator=g)[:n].tolist()
            times = []
            for _ in range(args.reps + 1):
                start = time.perf_counter()
                region.copy_from_peer(peer, {0: src}, {0: dst})
                times.append(time.perf_counter() - start)
            best = min(times[1:])  # the first includes one-time costs
            moved = n * region.block_bytes
            theirs = peer[0][0] if len(peer) == 1 else peer[0]
            assert torch.equal(mine[0][:, dst[0]].cpu(), theirs[:, src[0]].cpu())
            median = statistics.median(times[1:])
            print(f"  {tokens:5d}-token prompt: {moved / 1e6:7.1f} MB in {best * 1e3:7.2f} ms = {moved / best / 1e9:7.1f} GB/s"
                  f" best, {moved / median / 1e9:.1f} GB/s median (first copy {times[0] * 1e3:.2f} ms; every copy "
                  f"after it, ms: {', '.join(f'{t * 1e3:.2f}' for t in times[1:])})")
            rows.append({"tokens": tokens, "bytes": moved, "memory": kind, "best_gb_s": moved / best / 1e9,
                         "median_gb_s": moved / median / 1e9, "first_copy_s": times[0],
                         "copies_s": times[1:]})  # fmt: skip
    finally:
        child.communicate("\n", timeout=60)
    return rows


if __name__ == "__main__":
    main()
