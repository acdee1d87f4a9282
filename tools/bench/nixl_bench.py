"""The KV handoff through NIXL alone, between two processes in PID namespaces of
their own (and, with --hosts, network namespaces of their own: UCX over TCP on a
veth bridge, as between nodes): effective bandwidth of NixlConnector's read
(one transfer, a descriptor per run of blocks per cache tensor and k/v plane)
for a Llama-3-8B-shaped cache (32 layers, 8 kv heads of 128, 16-token blocks,
bf16 on a GPU), for 1k and 8k-token prompts, blocks scattered as a busy pool
scatters them. Both caches are one allocation, as the engine makes them. The
read blocks are checked byte for byte against the holder's.

    PYTHONPATH=$PWD python3 -m tools.bench.nixl_bench               # GPU: CUDA IPC under UCX
    .venv/bin/python -m tools.bench.nixl_bench --device cpu --layers 4 --hosts   # CPU, TCP between namespaces

Prints one JSON line per prompt length: GB/s per repetition (first dropped as a
warm-up), the median and the spread, with the device and the UCX transports.
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.raw_file import add_json_flag, write_rows

KV_CACHE = """
def kv_cache(shape, dtype, device):
    # --alloc fabric|posix_fd: the cache in cuMemCreate'd memory (shared/kv/memory/cuda_vmm.py), as UCX's
    # cuda_ipc needs across PID namespaces; otherwise torch's allocator, as the engine makes it.
    import os
    alloc = os.environ.get("INFERMESH_BENCH_ALLOC", "torch")
    if alloc == "torch" or device != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    from shared.kv.memory import cuda_vmm
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    mapping = cuda_vmm.allocate(nbytes, 0, cuda_vmm.HANDLE_FABRIC if alloc == "fabric" else cuda_vmm.HANDLE_POSIX_FD)
    return cuda_vmm.as_tensor(mapping, shape, dtype, 0)
"""

HOLDER = """
import base64, json, sys, torch
"""+KV_CACHE+"""
from shared.kv.connectors.nixl import tensor_geometry
from shared.kv.wire.nixl import MemoryRegion, NixlAgent
layers, blocks, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
gen = torch.Generator(device=device).manual_seed(0)
stacked = kv_cache((layers, 2, blocks, 16, 8, 128), dtype, device)
stacked.copy_(torch.randn((layers, 2, blocks, 16, 8, 128), generator=gen, device=device).to(dtype))
agent = NixlAgent("holder", ("UCX",))
agent.register([MemoryRegion(stacked.data_ptr(), stacked.numel() * stacked.element_size(), stacked.device.index or 0)],
               "VRAM" if device == "cuda" else "DRAM")
geometry = [[g.address, g.plane_stride, g.block_stride, g.block_bytes, g.device]
            for g in map(tensor_geometry, stacked.unbind(0))]
print("DESC " + json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "tensors": geometry}), flush=True)
notes = 0
for line in sys.stdin:
    notes += len(agent.take_notifications())
print("RESULT " + json.dumps({"notifications": notes}), flush=True)
"""

READER = """
import asyncio, base64, hashlib, json, random, statistics, sys, time, torch
"""+KV_CACHE+"""
from shared.kv.connectors.nixl import TensorGeometry, descriptors, tensor_geometry
from shared.kv.wire.nixl import MemoryRegion, NixlAgent
layers, blocks, device, reps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
prompts = [int(n) for n in sys.argv[5].split(",")]
holder = json.loads(sys.stdin.readline().removeprefix("DESC "))
dtype = torch.bfloat16 if device == "cuda" else torch.float32
ours = kv_cache((layers, 2, blocks, 16, 8, 128), dtype, device).zero_()
memory = "VRAM" if device == "cuda" else "DRAM"
agent = NixlAgent("reader", ("UCX",))
agent.register([MemoryRegion(ours.data_ptr(), ours.numel() * ours.element_size(), ours.device.index or 0)], memory)
agent.ensure_peer("holder", lambda: base64.b64decode(holder["metadata"]))
theirs = [TensorGeometry(*t) for t in holder["tensors"]]
mine = [tensor_geometry(t) for t in ours.unbind(0)]
gen = torch.Generator(device=device).manual_seed(0)
expected = torch.randn((layers, 2, blocks, 16, 8, 128), generator=gen, device=device).to(dtype)
rng = random.Random(0)

max_run = int(sys.argv[7])
poll_cap_s = float(sys.argv[8]) * 1e-6 if sys.argv[8] else None
op = sys.argv[9]
if op == "write":
    ours.copy_(expected.flip(2))  # not the holder's bytes where they land: a write that moved nothing fails the check

def scattered(n):
    # Runs of 1-max_run consecutive blocks at random places, as a pool that has served a while
    # hands them out (max_run 0: one run, as a fresh pool hands them out).
    ids, free = [], list(range(blocks))
    while len(ids) < n:
        start = rng.randrange(len(free) - n + 1) if not max_run else rng.randrange(len(free))
        run = free[start : start + (max_run and rng.randint(1, max_run) or n)][: n - len(ids)]
        ids += run
        del free[start : start + len(run)]
    return ids

kvcache = sys.argv[6] if len(sys.argv) > 6 else ""
loop = asyncio.new_event_loop()
client = None
if kvcache:
    from shared.kv.wire.client import KVCacheClient
    from shared.runtime import rpc
    from shared.runtime.settings import load_settings
    rpc.configure_from(load_settings().worker)  # the token the bench gave it (a prefill's)
    async def make_client():  # a gRPC channel belongs to the loop it is made on
        return KVCacheClient(kvcache, timeout_s=120.0, shm_bytes=0)
    client = loop.run_until_complete(make_client())

def stream_get(tokens, rep):
    # The same bytes from kvcache over its gRPC byte stream (put first, untimed).
    block = ours[:, :, 0].numel() * ours.element_size()
    hashes = [hashlib.sha256(f"{tokens}-{rep}-{i}".encode()).digest() for i in range(tokens // 16)]
    data = expected[:, :, : tokens // 16].transpose(0, 2).contiguous().cpu().view(torch.uint8).view(tokens // 16, -1)
    loop.run_until_complete(client.put_blocks([(h, "bench", data[i].numpy().tobytes()) for i, h in enumerate(hashes)]))
    async def get_all():
        return sum([sum(len(batch.block_data(i)) for i in range(len(batch.blocks))) async for batch in client.iter_landed(hashes)])
    started = time.perf_counter()
    nbytes = loop.run_until_complete(get_all())
    return nbytes, time.perf_counter() - started

for tokens in prompts:
    n = tokens // 16
    figures, stream, descs = [], [], 0
    for rep in range(reps + 1):
        paths = ["nixl", "stream"] if client is not None else ["nixl"]
        for path in paths if rep % 2 == 0 else paths[::-1]:
            if path == "stream":
                nbytes_s, seconds = stream_get(tokens, rep)
                if rep:
                    stream.append(nbytes_s / seconds / 1e9)
                continue
            src, dst = scattered(n), scattered(n)
            remote, local = descriptors({0: src}, {0: dst}, {0: list(range(layers))}, theirs, mine)
            descs = len(remote)
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            if op == "read":
                nbytes = agent.read("holder", local, remote, memory, memory, b"done", 60.0, poll_cap_s)
            else:  # the same bytes the other way: ours written into the holder's blocks (a put)
                nbytes = agent.write("holder", local, remote, memory, memory, 60.0, b"done", poll_cap_s)
            seconds = time.perf_counter() - started
            if rep == 0:
                idx_s = torch.tensor(src, device=device)
                idx_d = torch.tensor(dst, device=device)
                if op == "write":  # read the written blocks back to check them
                    sent = ours.index_select(2, idx_d).clone()
                    ours.zero_()
                    if device == "cuda":  # the zeroing runs on torch's stream, UCX's copies on their own:
                        torch.cuda.synchronize()  # unsynchronised it zeroed blocks the read had landed
                    agent.read("holder", local, remote, memory, memory, b"", 60.0, poll_cap_s)
                    if not torch.equal(ours.index_select(2, idx_d), sent):
                        raise SystemExit("the blocks written are not in the holder's cache")
                elif not torch.equal(ours.index_select(2, idx_d), expected.index_select(2, idx_s)):
                    raise SystemExit("the blocks read are not the holder's")
                if device == "cuda":
                    # The bound: the same gather and scatter of blocks within one process.
                    for _ in range(2):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        ours.index_copy_(2, idx_d, expected.index_select(2, idx_s))
                        torch.cuda.synchronize()
                        local_copy = nbytes / (time.perf_counter() - t0) / 1e9
            else:
                figures.append(nbytes / seconds / 1e9)
    row = {"prompt_tokens": tokens, "bytes": nbytes, "descriptors": descs,
           "gb_per_s": [round(f, 2) for f in figures], "median_gb_per_s": round(statistics.median(figures), 2),
           "min": round(min(figures), 2), "max": round(max(figures), 2), "op": op}
    if device == "cuda":
        row["one_process_copy_gb_per_s"] = round(local_copy, 1)
    if stream:
        ratios = [a / b for a, b in zip(figures, stream)]
        row.update(stream_gb_per_s=[round(f, 3) for f in stream], stream_median_gb_per_s=round(statistics.median(stream), 3),
                   nixl_over_stream_median=round(statistics.median(ratios), 1),
                   nixl_over_stream_min=round(min(ratios), 1), nixl_over_stream_max=round(max(ratios), 1))
    print("ROW " + json.dumps(row), flush=True)
"""


def _line(stream, prefix: str) -> str:  # noqa: ANN001
    """The next line of a child's stdout that starts with prefix (without it); "" at its end."""
    for line in stream:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=2048, help="blocks of 16 tokens in each cache")
    p.add_argument("--prompts", default="1024,8192")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hosts", action="store_true", help="each process in a network namespace of its own (TCP)")
    p.add_argument("--one-pid-namespace", action="store_true", help="no PID namespaces (where unshare is refused)")
    p.add_argument("--stream", action="store_true",
                   help="with --hosts: also read the same bytes from kvcache (in the holder's namespace) over its "
                        "gRPC byte stream, alternating with the NIXL reads, and print the ratio")
    p.add_argument("--max-run", type=int, default=8,
                   help="blocks are handed out in runs of 1..N consecutive ones (0: one run, a fresh pool)")
    p.add_argument("--op", choices=("read", "write"), default="read",
                   help="read: the reader gets the holder's blocks (the connector's way); write: it puts its own "
                        "into the holder's (a prefill writing into decode's blocks), checked by reading them back")
    p.add_argument("--alloc", choices=("torch", "fabric", "posix_fd"), default="torch",
                   help="GPU caches from torch's allocator (legacy CUDA IPC handles) or cuMemCreate'd with fabric "
                        "or POSIX-fd handles (UCX's cuda_ipc crosses PID namespaces only with fabric handles)")
    p.add_argument("--poll-cap-us", default="", help="the reader's longest pause between polls (default: by memory)")
    add_json_flag(p)
    args = p.parse_args(argv)
    rows: list[dict] = []
    from shared.kv.wire.nixl import UCX_CUDA_DEFAULTS

    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "INFERMESH_BENCH_ALLOC": args.alloc}
    py = [sys.executable, "-c"]
    hosts = None
    if args.hosts:
        from tools.launch.netns import namespaces

        lab = namespaces(["holder", "reader"])
        hosts = lab.__enter__()
        env.setdefault("UCX_TLS", "tcp")

    def command(role: str, code: str, *rest: str) -> list[str]:
        argv = [*py, code, *rest]
        if hosts is not None:
            return hosts.command(role, argv)
        if args.one_pid_namespace:
            return argv
        return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]

    sizes = [str(args.layers), str(args.blocks), args.device]
    stack = contextlib.ExitStack()
    kvcache = ""
    try:
        if args.stream:
            if hosts is None:
                raise SystemExit("--stream needs --hosts")
            env = with_prefill_token(env)  # the reader stores and reads blocks as prefill does
            kvcache = stack.enter_context(kvcache_in_host(hosts, "holder", env))
        holder = subprocess.Popen(command("holder", HOLDER, *sizes), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)  # fmt: skip
        assert holder.stdout is not None and holder.stdin is not None
        described = _line(holder.stdout, "DESC ")
        if not described:
            raise SystemExit("the holder did not start")
        reader = subprocess.run(command("reader", READER, *sizes, str(args.reps), args.prompts, kvcache,
                                        str(args.max_run), args.poll_cap_us, args.op),
                                input=described + "\n",
                                capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        holder.stdin.write("\n")
        holder.stdin.close()
        notes = json.loads(_line(holder.stdout, "RESULT ") or "{}").get("notifications")
        holder.wait(timeout=30)
        if reader.returncode:
            sys.stderr.write(reader.stderr)
            raise SystemExit(f"the reader failed ({reader.returncode})")
        device = args.device
        if device == "cuda":
            import torch

            device = torch.cuda.get_device_name()
        for line in reader.stdout.splitlines():
            if not line.startswith("ROW "):
                continue  # UCX and NIXL may write to stdout too
            row = json.loads(line[4:])
            row.update(device=device, layers=args.layers, ucx_tls=env.get("UCX_TLS", "(UCX's choice)"),
                       max_run=args.max_run, alloc=args.alloc, poll_cap_us=args.poll_cap_us or "(by memory)",
                       cuda_ipc_max_poll=env.get("UCX_CUDA_IPC_MAX_POLL", f"{UCX_CUDA_DEFAULTS['UCX_CUDA_IPC_MAX_POLL']} (ours)"),
                       namespaces="net+pid" if hosts is not None else ("none" if args.one_pid_namespace else "pid"), holder_notifications=notes)  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
        write_rows(args.json, rows)
    finally:
        try:
            stack.close()
        finally:
            if hosts is not None:
                lab.__exit__(None, None, None)
    return 0


def with_prefill_token(env: dict[str, str]) -> dict[str, str]:
    """env with a fresh token of the prefill identity (worker.grpc_token): what a bench's
    kvcache client presents, and what kvcache_in_host's kvcache is told to know."""
    from tools.launch.nats_auth import grpc_tokens

    return {**env, "INFERMESH_WORKER__GRPC_TOKEN": grpc_tokens()["prefill"]}


@contextlib.contextmanager
def kvcache_in_host(hosts, name: str, env: dict[str, str]):  # noqa: ANN001, ANN202
    """nats-server on the bridge and `python -m services.kvcache` in host `name`; yields the
    address a client in another host dials. kvcache binds beyond loopback, so it serves only
    the prefill token env carries (with_prefill_token), its one peer."""
    from shared.runtime.rpc_auth import peers_setting
    from tools.launch.up import find_nats_server, free_port, grpc_serving

    nats_port, kv_port = free_port(), free_port()
    address = f"{hosts[name].address}:{kv_port}"
    tmp = stack_dir = tempfile.mkdtemp(prefix="infermesh-nixlbench-")
    service_env = {**env, "INFERMESH_NATS__URL": f"nats://{hosts.gateway}:{nats_port}",
                   "INFERMESH_KVCACHE__ADDRESS": address, "INFERMESH_WORKER__BIND_HOST": hosts[name].address,
                   "INFERMESH_KVCACHE__PATH": f"{tmp}/kvcache", "INFERMESH_KVCACHE__CAPACITY_BYTES": str(8 << 30),
                   "INFERMESH_TELEMETRY__TRACE_DIR": f"{tmp}/traces",
                   "INFERMESH_WORKER__DRAIN_TIMEOUT_S": "2",
                   "INFERMESH_WORKER__GRPC_PEERS": peers_setting({"prefill": env["INFERMESH_WORKER__GRPC_TOKEN"]})}  # fmt: skip
    nats = subprocess.Popen([find_nats_server(), "-a", hosts.gateway, "-p", str(nats_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    log = open(f"{stack_dir}/kvcache.log", "wb")
    kv = subprocess.Popen(hosts.command(name, [sys.executable, "-m", "services.kvcache"]), env=service_env,
                          stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not grpc_serving(address):
            if kv.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = Path(f"{stack_dir}/kvcache.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"kvcache did not start ({stack_dir}/kvcache.log):\n{tail}")
            time.sleep(0.2)
        yield address
    finally:
        for proc in (kv, nats):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
