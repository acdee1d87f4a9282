"""What the expert-parallel mesh tests share (tests/mesh/test_mesh_expert_load.py and
test_mesh_eplb.py): a MoE checkpoint's count of MoE layers and the decode instances'
heartbeats heard on the bus."""

import asyncio
import json
import time
from pathlib import Path

from shared.proto import mesh_pb2
from shared.runtime import subjects


def moe_layers(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return config["num_hidden_layers"] - len(config["mlp_only_layers"])


def decode_heartbeats(nats_url: str, seconds: float) -> list[mesh_pb2.Heartbeat]:
    """The decode instances' heartbeats heard over `seconds`."""
    import nats

    async def go() -> list[mesh_pb2.Heartbeat]:
        nc = await nats.connect(nats_url)
        sub = await nc.subscribe(subjects.heartbeats_of("decode"))
        beats, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except asyncio.TimeoutError:
                break
            beats.append(mesh_pb2.Heartbeat.FromString(msg.data))
        await nc.close()
        return beats

    return asyncio.run(go())
