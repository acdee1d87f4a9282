"""POST /reset_prefix_cache (vLLM's endpoint of that name, for the mesh): every live
prefill and decode instance flushes the KV it writes behind to kvcache, then forgets
the blocks it keeps for reuse (device prefix cache, host tier), as a restart would,
the process kept. kvcache keeps its copies, so the next request with such a prefix
loads it from kvcache: what `infermesh profile`'s kvcache round measures
(tools/planner/kvcache_round.py). Behind the API key, as /v1 is; every later
request pays for it, so it is an operator's tool, not a user's."""

import asyncio
from dataclasses import dataclass, field

from services.balancer.router.registry import Registry
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus

RESET_STAGES = ("prefill", "decode")
"""The stages whose instances keep KV for reuse (a vision instance's embedding cache is not KV)."""


@dataclass(slots=True)
class ResetOutcome:
    instances: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per instance that answered: device_blocks, host_blocks (dropped), unflushed (blocks
    written behind that were not in kvcache yet when the instance stopped waiting)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Per instance that did not answer in time, why."""

    def body(self) -> dict:
        return {"instances": self.instances, "failed": self.failed}


async def reset_prefix_caches(registry: Registry, bus: Bus, timeout_s: float) -> ResetOutcome:
    """Ask every live prefill and decode instance at once; wait for each up to timeout_s
    (an instance flushes its saves written behind first: worker.kv_flush_timeout_s)."""
    targets = [inst for stage in RESET_STAGES for inst in registry.live(stage)]
    replies = await asyncio.gather(*(
        bus.request(subjects.reset_prefix_cache(inst.stage, inst.instance_id), mesh_pb2.ResetPrefixCache(),
                    mesh_pb2.PrefixCacheReset, timeout=timeout_s)
        for inst in targets), return_exceptions=True)  # fmt: skip
    outcome = ResetOutcome()
    for inst, reply in zip(targets, replies):
        if isinstance(reply, BaseException):
            outcome.failed[inst.instance_id] = f"{type(reply).__name__}: {reply}"
        else:
            outcome.instances[inst.instance_id] = {"device_blocks": reply.num_device_blocks,
                                                   "host_blocks": reply.num_host_blocks,
                                                   "unflushed": reply.num_unflushed}  # fmt: skip
    return outcome
