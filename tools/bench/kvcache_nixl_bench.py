"""kvcache Gets through NIXL against its gRPC byte stream, side by side in one run,
the client and the service on hosts of their own (network and PID namespaces on
a bridge, tools/launch/netns.py: UCX over TCP, no shared memory, as between
nodes).

    .venv/bin/python -m tools.bench.kvcache_nixl_bench [--tokens 8192] [--layers 8] [--rounds 7] [--log FILE]

The parent makes the two hosts, starts nats-server on the bridge and
`python -m services.kvcache` in host "kvcache" (nixl_bench's set-up, default
settings: NIXL on, 256 MiB of staging), then runs the client in host "client".
The client stores a prompt's blocks once (one block per 16 tokens, every layer
of a Llama-3-8B-shaped cache: 8 kv heads of 128, float32 as on the CPU), then
per round Gets them all through each of two clients: the stream one (shared
memory and NIXL off) and the NIXL one (shared memory off, a landing buffer of
kv_transfer.kvcache_nixl_bytes, 64 MiB by default: the service writes a Get in
pieces of its staging slot). Round r starts with path r mod 2; round 0 warms
up (connections, buffers, pages), checks every block's bytes on both paths and
is dropped. A Get is the transport alone: each batch is handed over as it
lands, no copy by the caller. The NIXL client must have had no byte by stream.

Prints one line per round (GB/s of each path, 10^9 bytes/s, and their ratio)
and the summary: the median and min-max of the per-round ratio NIXL / stream.
--log writes the same under the raw-file header. Needs root (namespaces).
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

PATHS = ("stream", "nixl")
BLOCK_TOKENS = 16
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 4


def block_bytes(layers: int) -> int:
    """One kvcache block: every layer's k and v of BLOCK_TOKENS tokens."""
    return layers * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES


async def _get_all(client, hashes: list, check: list[bytes] | None) -> int:  # noqa: ANN001 - KVCacheClient
    """Blocks got (each checked against `check` when given)."""
    got = 0
    async for batch in client.iter_landed(hashes):
        if check is not None:
            for i in range(len(batch.blocks)):
                if bytes(batch.block_data(i)) != check[got + i]:
                    raise RuntimeError(f"block {got + i} differs from the bytes stored")
        got += len(batch.blocks)
    return got


def client_main(address: str, num_blocks: int, size: int, rounds: int) -> None:
    """In the client's host: store, then time the Gets; a ROUND line per round."""
    from shared.kv.wire.client import KVCacheClient, Plane
    from shared.runtime import rpc
    from shared.runtime.settings import KVTransferSettings, load_settings
    from tools.bench.kvcache_bench import hashes_for

    rpc.configure_from(load_settings().worker)  # the token the bench gave it (a prefill's)

    datas = [os.urandom(size) for _ in range(num_blocks)]
    hashes = hashes_for(f"kvnixl-{os.getpid()}-{time.time_ns()}", num_blocks)
    total = num_blocks * size
    nixl_bytes = KVTransferSettings().kvcache_nixl_bytes

    async def go() -> None:
        clients = {"stream": KVCacheClient(address, timeout_s=300.0, shm_bytes=0),
                   "nixl": KVCacheClient(address, timeout_s=300.0, shm_bytes=0, nixl_bytes=nixl_bytes)}
        try:
            await clients["stream"].put_blocks([(h, f"u8[{size}]", d) for h, d in zip(hashes, datas)])
            for round_ in range(rounds + 1):
                gbps = {}
                for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
                    started = time.perf_counter()
                    got = await _get_all(clients[path], hashes, datas if round_ == 0 else None)
                    seconds = time.perf_counter() - started
                    if got != num_blocks:
                        raise RuntimeError(f"{path}: got {got} of {num_blocks} blocks")
                    gbps[path] = total / seconds / 1e9
                row = {"round": round_, "warm_up": round_ == 0, "first": PATHS[round_ % 2],
                       "stream_gb_per_s": round(gbps["stream"], 3), "nixl_gb_per_s": round(gbps["nixl"], 3),
                       "nixl_over_stream": round(gbps["nixl"] / gbps["stream"], 2)}
                print("ROUND " + json.dumps(row), flush=True)
            nixl = clients["nixl"]
            if nixl.get_bytes[Plane.STREAM] or nixl.nixl.num_refused or not nixl.nixl.num_nixl_calls:
                raise RuntimeError(f"the NIXL client did not keep to NIXL: {nixl.nixl}, {nixl.get_bytes}")
            print("CALLS " + json.dumps({"nixl_gets": nixl.nixl.num_nixl_calls, "nixl_landing_bytes": nixl_bytes}),
                  flush=True)
        finally:
            for client in clients.values():
                await client.close()

    asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    from tools.bench.raw_file import add_json_flag

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="the prompt's tokens (a block per 16)")
    p.add_argument("--layers", type=int, default=8, help="layers of the cache (8: nixl_bench's CPU shape)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, after one warm-up round (>= 5)")
    p.add_argument("--log", help="the raw file (docs/perf/...), under the header")
    p.add_argument("--client", help=argparse.SUPPRESS)  # the child: kvcache's address
    add_json_flag(p)
    args = p.parse_args(argv)
    num_blocks, size = args.tokens // BLOCK_TOKENS, block_bytes(args.layers)
    if num_blocks < 1 or args.layers < 1 or args.rounds < 5:
        p.error("--tokens must be at least 16, --layers at least 1, --rounds at least 5")
    if args.client:
        client_main(args.client, num_blocks, size, args.rounds)
        return 0

    from tools.bench.nixl_bench import kvcache_in_host, with_prefill_token
    from tools.bench.raw_file import tee_stdout, write_rows
    from tools.launch.netns import namespaces

    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("UCX_TLS", "tcp")  # between hosts; UCX_NET_DEVICES: each namespace has eth0 and lo alone
    env = with_prefill_token(env)  # the client stores and reads blocks as prefill does
    with tee_stdout(args.log), namespaces(["kvcache", "client"]) as hosts, kvcache_in_host(hosts, "kvcache", env) as address:
        print(f"kvcache Get of a {args.tokens}-token prompt: {num_blocks} blocks of {size / 2**20:g} MiB "
              f"({num_blocks * size / 2**20:g} MiB; {args.layers} layers x 8 kv heads x 128, float32), "
              f"client and kvcache in network+PID namespaces of their own, UCX_TLS={env['UCX_TLS']}; "
              f"shared memory off on both clients; {args.rounds} timed rounds after a warm-up, order rotating",
              flush=True)
        child = subprocess.run(hosts.command("client", [sys.executable, "-m", "tools.bench.kvcache_nixl_bench",
                                                        "--client", address, "--tokens", str(args.tokens),
                                                        "--layers", str(args.layers), "--rounds", str(args.rounds)]),
                               capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
        rows = []
        for line in child.stdout.splitlines():
            if line.startswith(("ROUND ", "CALLS ")):
                print(line, flush=True)
                if line.startswith("ROUND "):
                    rows.append(json.loads(line[6:]))
        if child.returncode:
            sys.stderr.write(child.stderr[-4000:])
            raise SystemExit(f"the client failed ({child.returncode})")
        timed = [r for r in rows if not r["warm_up"]]
        ratios = [r["nixl_over_stream"] for r in timed]
        summary = {
            "timed_rounds": len(timed),
            "stream_median_gb_per_s": round(statistics.median(r["stream_gb_per_s"] for r in timed), 3),
            "nixl_median_gb_per_s": round(statistics.median(r["nixl_gb_per_s"] for r in timed), 3),
            "nixl_over_stream_median": round(statistics.median(ratios), 2),
            "nixl_over_stream_min": min(ratios),
            "nixl_over_stream_max": max(ratios),
        }
        print("SUMMARY " + json.dumps(summary), flush=True)
        write_rows(args.json, rows, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
