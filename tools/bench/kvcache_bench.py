"""The kvcache tier's own speed: the gRPC byte stream against the shared-memory
segment, side by side in one run, against a real service process.

    .venv/bin/python -m tools.bench.kvcache_bench [--blocks 230] [--block-mib 2] [--rounds 3] [--device cuda] \
        [--log docs/perf/kvcache_bench.log]

It starts nats-server and `python -m services.kvcache` (as `infermesh up` does,
LMDB in a temporary folder), then per round and per path (byte stream:
kvcache.shm_bytes=0; shared memory: --shm-mib), alternating so both see the same
machine:

  put      the client stores N fresh blocks (distinct hashes per path and round);
  get      the client Gets them back, each batch handed over as it lands, no copy
           by the caller (the transport alone);
  load     KVCacheConnector.start_load of the N blocks into a KVRegion shaped as
           an 8B Llama's (32 layers, 16-token blocks, 8 KV heads of 128, bfloat16:
           2 MiB a block) on --device (cpu; cuda: the connector pins its segment),
           polled to its end: the engine's path, landing and the copy into the
           cache included. The loaded cache is checked byte for byte.

It prints GB/s (10^9 bytes/s; medians of the rounds) per path and the ratio
shared memory / byte stream. The default N = 230 blocks of 2 MiB is the 460 MiB
of a 4k prompt 90 % cached (docs/perf/README.md, "The KV tiers").
"""

import argparse
import asyncio
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.memory.region import KVRegion
from shared.kv.spec import kv_cache_layout
from shared.kv.transfer import KVTransferParams
from shared.kv.wire.client import KVCacheClient
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows
from tools.bench.tier_bench import kvcache_service

PATHS = ("bytes", "shm")
# An 8B Llama's block (Llama-3-8B: 32 layers, 8 KV heads of 128): 2 MiB at 16 tokens in bf16.
LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 32, 16, 8, 128


@dataclass(slots=True)
class Figures:
    put: list[float]
    get: list[float]
    load: list[float]


def make_region(num_blocks: int, block_mib: float, device: str = "cpu") -> KVRegion:
    """A KV cache of num_blocks blocks, 32 layers, block_mib MiB a block (the head
    count scaled from the 8B shape's 8 to reach it)."""
    heads = max(1, round(KV_HEADS * block_mib / 2))
    stacked = torch.zeros((LAYERS, 2, num_blocks, BLOCK_TOKENS, heads, HEAD_DIM), dtype=torch.bfloat16,
                          device=device)
    return KVRegion(list(stacked.unbind(0)), kv_cache_layout([None] * LAYERS))


def hashes_for(tag: str, n: int) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def load_into(connector: KVCacheConnector, hashes: list[BlockHash], timeout_s: float = 120.0) -> int:
    """The engine's load of these blocks into blocks 0..n-1, polled to its end."""
    connector.start_load("bench", 0, hashes, {0: list(range(len(hashes)))}, KVTransferParams(load=True))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads, _ = connector.poll()
        if loads:
            if loads[0].error:
                raise RuntimeError(f"the load failed: {loads[0].error}")
            return loads[0].num_blocks
        time.sleep(0.0005)
    raise TimeoutError("the load did not finish")


def run(num_blocks: int, block_mib: float, rounds: int, shm_mib: int, device: str = "cpu") -> dict[str, Figures]:
    region = make_region(num_blocks, block_mib, device)
    block_bytes = region.block_bytes
    total = num_blocks * block_bytes
    payload = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    datas = [payload[i].numpy().tobytes() for i in range(num_blocks)]
    figures = {path: Figures([], [], []) for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="infermesh-kvbench-") as tmp:
        capacity = 2 * (rounds + 1) * len(PATHS) * total + (1 << 30)
        with kvcache_service(Path(tmp), capacity) as address:
            loop = asyncio.new_event_loop()
            shm_bytes = {"bytes": 0, "shm": shm_mib << 20}

            async def make_clients() -> dict[str, KVCacheClient]:  # a channel belongs to the loop it is made on
                return {p: KVCacheClient(address, timeout_s=120.0, shm_bytes=shm_bytes[p]) for p in PATHS}

            clients = loop.run_until_complete(make_clients())
            connectors = {p: KVCacheConnector(address, timeout_s=120.0, load_when_faster=False,
                                              shm_bytes=shm_bytes[p]) for p in PATHS}
            for connector in connectors.values():
                connector.register_kv_region(region)
            try:
                for round_ in range(rounds + 1):  # round 0 warms up (segments, pages, connections)
                    for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
                        client = clients[path]
                        hashes = hashes_for(f"{path}-{round_}", num_blocks)
                        blocks = [(h, region.layout, d) for h, d in zip(hashes, datas)]
                        put_s = timed(lambda: loop.run_until_complete(client.put_blocks(blocks)))

                        async def get_all() -> int:
                            return sum([len(b.blocks) async for b in client.iter_landed(hashes)])

                        got: list[int] = []
                        get_s = timed(lambda: got.append(loop.run_until_complete(get_all())))
                        region.stacked.zero_()
                        loaded: list[int] = []
                        load_s = timed(lambda: loaded.append(load_into(connectors[path], hashes)))
                        if got != [num_blocks] or loaded != [num_blocks]:
                            raise RuntimeError(f"{path}: got {got}, loaded {loaded} of {num_blocks} blocks")
                        if not torch.equal(region.read_payloads({0: list(range(num_blocks))}).cpu(), payload):
                            raise RuntimeError(f"{path}: the loaded cache is not the blocks put")
                        if round_ > 0:
                            figures[path].put.append(total / put_s / 1e9)
                            figures[path].get.append(total / get_s / 1e9)
                            figures[path].load.append(total / load_s / 1e9)
                shm = clients["shm"].shm
                if shm.num_byte_calls or not shm.num_shm_calls:
                    raise RuntimeError(f"the shm client did not use shared memory: {shm}")
            finally:
                for connector in connectors.values():
                    connector.close()
                for client in clients.values():
                    loop.run_until_complete(client.close())
                loop.close()
    return figures


def table(figures: dict[str, Figures], num_blocks: int, block_bytes: int, device: str = "cpu") -> list[str]:
    lines = [
        f"kvcache bench: {num_blocks} blocks of {block_bytes / (1 << 20):.2f} MiB, load into a {device} KVRegion "
        f"({num_blocks * block_bytes / (1 << 20):.0f} MiB), GB/s, median of {len(figures['bytes'].put)} rounds",
        "",
        "| step | byte stream | shared memory | shm / bytes |",
        "|---|---|---|---|",
    ]
    for step in ("put", "get", "load"):
        b = statistics.median(getattr(figures["bytes"], step))
        s = statistics.median(getattr(figures["shm"], step))
        lines.append(f"| {step} | {b:.2f} | {s:.2f} | {s / b:.1f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=230, help="blocks per put/get/load (230: 460 MiB of 2 MiB)")
    parser.add_argument("--block-mib", type=float, default=2.0, help="MiB per block (2: an 8B model's 16 tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per path, after one warm-up round")
    parser.add_argument("--shm-mib", type=int, default=256, help="the shm client's segment (kvcache.shm_bytes)")
    parser.add_argument("--device", default="cpu", help="where the loaded KVRegion lives (cpu, cuda)")
    parser.add_argument("--log", default=None, metavar="PATH", help="the raw file: the table and every round's "
                        "figures, under tools/bench/raw_file.py's header")  # fmt: skip
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.rounds < 1:
        parser.error("--blocks and --rounds must be at least 1")
    with tee_stdout(args.log):
        figures = run(args.blocks, args.block_mib, args.rounds, args.shm_mib, args.device)
        block_bytes = make_region(1, args.block_mib).block_bytes
        print("\n".join(table(figures, args.blocks, block_bytes, args.device)))
        # Every round, not only the medians: the spread is part of the figure.
        for path in PATHS:
            for step in ("put", "get", "load"):
                values = ", ".join(f"{v:.2f}" for v in getattr(figures[path], step))
                print(f"  {path:<5} {step:<4} GB/s per round: {values}")
    rows = [
        {"path": path, "step": step, "median_gb_s": statistics.median(getattr(figures[path], step)),
         "gb_s_per_round": getattr(figures[path], step)}
        for path in PATHS
        for step in ("put", "get", "load")
    ]  # fmt: skip
    write_rows(args.json, rows, blocks=args.blocks, block_bytes=block_bytes, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
