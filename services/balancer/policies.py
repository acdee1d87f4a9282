"""One routing policy per stage. Each returns the chosen instance and the
figures it chose by, which go on the request's trace span.

- prefill: the instance holding the most leading blocks of the prompt in its
  own memory (recomputing nothing it already has); ties broken at random; when
  nobody holds any, the least loaded by tokens waiting to be computed.
- decode: the least loaded by running + waiting requests, then by the most
  free KV blocks; ties broken at random.

Random tie-breaks matter: a burst of requests between two heartbeats would
otherwise all go to the first instance in the list.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shared.kv.block_hash import BlockHash
from services.balancer.registry import Instance


@dataclass(slots=True)
class Choice:
    instance: Instance
    reason: str
    scores: dict[str, float]
    """Per candidate instance id: the figure it was ranked by."""


def _pick(candidates: Sequence[Instance], key, rng: random.Random) -> Instance:  # noqa: ANN001
    best = min(key(c) for c in candidates)
    return rng.choice([c for c in candidates if key(c) == best])


def leading_blocks_held(inst: Instance, hashes: Sequence[BlockHash]) -> int:
    n = 0
    for h in hashes:
        if h not in inst.blocks:
            break
        n += 1
    return n


def choose_prefill(candidates: Sequence[Instance], hashes: Sequence[BlockHash], rng: random.Random) -> Choice:
    if not candidates:
        raise LookupError("no live prefill instance")
    held = {c.instance_id: leading_blocks_held(c, hashes) for c in candidates}
    if max(held.values()) > 0:
        inst = _pick(candidates, lambda c: -held[c.instance_id], rng)
        return Choice(inst, "prefix", {k: float(v) for k, v in held.items()})
    load = {c.instance_id: float(c.load.num_queued_tokens + c.in_flight) for c in candidates}
    inst = _pick(candidates, lambda c: load[c.instance_id], rng)
    return Choice(inst, "least_loaded", load)


def choose_decode(candidates: Sequence[Instance], rng: random.Random) -> Choice:
    if not candidates:
        raise LookupError("no live decode instance")

    def key(c: Instance) -> tuple[int, int]:
        return (c.load.num_running + c.load.num_waiting + c.in_flight, -c.load.num_free_kv_blocks)

    inst = _pick(candidates, key, rng)
    return Choice(inst, "least_loaded", {c.instance_id: float(key(c)[0]) for c in candidates})
