"""One routing policy per stage. Each returns the chosen instance and the
figures it chose by, which go on the request's trace span.

- prefill (choose_prefill): the least cost in KV blocks, Dynamo's KV-router cost:
  overlap_weight x the prompt's blocks the instance would compute (those beyond
  the leading blocks it holds in its own memory), plus the blocks queued there
  (its heartbeat's queued tokens and what this balancer sent it since, over the
  block size; divided by the step balancedness for MoE instances). Queued means
  the whole prompt of each request not past its prefill, cached blocks included
  (shared/engine/outputs.py queued_prompt_tokens: one definition for heartbeat and
  reservation): a held prefix is worth its blocks of queue, no more, and a holder
  of a system prompt every request shares is loaded by every request on it, however
  short its own tokens. Once it has one queued, an idle instance computes the
  prefix once and holds it too; the hit rate is kept after those few misses.
  (Counting only the tokens to compute, six requests of 16 own tokens after a 1k
  prefix weighed 6 blocks against the 64 a miss costs: all went to one holder.)
  Ties broken at random.
- decode: the least loaded by running + waiting requests, then by the most
  free KV blocks; ties broken at random. With conditional disaggregation on,
  where a prompt may be computed on its decode instance, the one with the least
  work for this request in KV blocks instead (choose_decode_by_cache, the same
  cost and overlap weight as prefill's): a turn of
  a conversation goes back to the instance that holds the conversation.
- expert-parallel (the EP load balancer, DeepSeek's third beside prefill's and
  decode's): among MoE instances, whose heartbeats carry their expert load, the
  one whose next step would be shortest: its requests plus this one, divided by
  the balancedness of its steps (choose_expert_parallel, for decode; prefill's
  least-loaded fallback divides its queued tokens the same way). An instance
  whose experts sit unevenly on its ranks waits each layer for its busiest rank.
- vision (choose_vision, E/P/D): the instance with the least image work for this
  request: its images the instance's embedding cache lacks (from its heartbeat)
  plus the images queued and in its tower (cache affinity weighed against load).
- vision's crossover (encode_on_prefill, E/P/D): a lone image of few tokens that no
  vision instance holds is encoded by prefill itself, where its tower run costs less
  than a round trip to a vision instance and a fetch of its embeddings (SGLang's
  adaptive dispatch); off unless vision.prefill_max_image_tokens is set.
- where the prompt is computed (choose_prefill_site): on a prefill instance, or
  on the decode instance when the prompt is short or prefill is the bottleneck
  (conditional disaggregation; off unless its settings are set).

Random tie-breaks matter: a burst of requests between two heartbeats would
otherwise all go to the first instance in the list.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.kv.block_hash import BlockHash
from services.balancer.router.registry import Instance


@dataclass(slots=True)
class Choice:
    instance: Instance
    reason: str
    scores: dict[str, float]
    """Per candidate instance id: the figure it was ranked by."""
    held: dict[str, int] = field(default_factory=dict)
    """Per candidate instance id: the prompt's leading blocks it holds (cache-aware choices only)."""


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


def step_balancedness(inst: Instance) -> float:
    """How evenly an MoE instance's steps spread over its expert-parallel ranks, from its
    heartbeat: the sum over MoE layers of the mean tokens per rank over the sum of the
    busiest rank's. Each layer's all-to-all waits for that layer's busiest rank and the
    layers run one after another, so a step's expert compute takes the sum of the
    per-layer maxima, where even ranks would take the sum of the means (per layer first:
    summing tokens over layers before taking the max would hide a layer's hot rank).
    1.0 when it reports no expert load (a dense model) or its window saw no tokens."""
    layers = inst.load.expert_load.layers
    busiest = sum(layer.max_tokens_per_rank for layer in layers)
    return sum(layer.mean_tokens_per_rank for layer in layers) / busiest if busiest else 1.0


def serves_expert_parallel(candidates: Sequence[Instance]) -> bool:
    """Whether the candidates are MoE instances the EP policy ranks: any reports its expert
    load. (The mesh serves one model, so either all do, or those that do not have not
    stepped yet: they count as balanced.)"""
    return any(c.load.HasField("expert_load") for c in candidates)


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """The KV blocks a prompt fills, the last one partly."""
    return -(-prompt_tokens // block_size)


def choose_prefill(
    candidates: Sequence[Instance], hashes: Sequence[BlockHash], prompt_tokens: int, block_size: int,
    rng: random.Random, overlap_weight: float = 1.0,
) -> Choice:
    """The prefill instance of least cost in KV blocks (Dynamo's KV router): overlap_weight
    x the blocks it would compute for this prompt, plus the blocks queued there (the
    whole prompts of its requests not past prefill: queued_prefill_tokens). The
    weight says how many blocks of queue a block held is worth: 1 (Dynamo's default)
    counts a block computed as a block waited for; 0 ignores caches (pure load); a
    large weight ranks by prefix first (the old policy, which let a shared prefix take
    all traffic). Ties broken at random."""
    if not candidates:
        raise LookupError("no live prefill instance")
    expert_parallel = serves_expert_parallel(candidates)  # a queued token costs more where experts sit unevenly
    total = prompt_blocks(prompt_tokens, block_size)
    held = {c.instance_id: leading_blocks_held(c, hashes) for c in candidates}

    def cost(c: Instance) -> float:
        queued = queued_prefill_tokens(c) / block_size
        if expert_parallel:
            queued /= step_balancedness(c)
        return overlap_weight * max(total - held[c.instance_id], 0) + queued

    costs = {c.instance_id: cost(c) for c in candidates}
    inst = _pick(candidates, lambda c: costs[c.instance_id], rng)
    if held[inst.instance_id] > 0:
        reason = "prefix"
    else:
        reason = "expert_balance" if expert_parallel else "least_loaded"
    return Choice(inst, reason, costs, held)


def choose_decode(candidates: Sequence[Instance], rng: random.Random) -> Choice:
    if not candidates:
        raise LookupError("no live decode instance")

    def key(c: Instance) -> tuple[int, int]:
        return (c.load.num_running + c.load.num_waiting + c.in_flight, -c.load.num_free_kv_blocks)

    inst = _pick(candidates, key, rng)
    return Choice(inst, "least_loaded", {c.instance_id: float(key(c)[0]) for c in candidates})


def choose_expert_parallel(candidates: Sequence[Instance], rng: random.Random) -> Choice:
    """The EP load balancer's decode choice: the instance whose next step, with this
    request in its batch, is shortest. A step's expert compute grows with the requests
    in it (running, waiting, sent since the last heartbeat, and this one) and with how
    unevenly they land on the ranks: divided by the step balancedness, so that an idle
    instance at 0.5 weighs as one running a request at 1.0. Then the most free KV
    blocks; ties broken at random."""
    if not candidates:
        raise LookupError("no live decode instance")

    def cost(c: Instance) -> float:
        return (c.load.num_running + c.load.num_waiting + c.in_flight + 1) / step_balancedness(c)

    costs = {c.instance_id: cost(c) for c in candidates}
    inst = _pick(candidates, lambda c: (costs[c.instance_id], -c.load.num_free_kv_blocks), rng)
    return Choice(inst, "expert_balance", costs)


def choose_decode_by_cache(
    candidates: Sequence[Instance], hashes: Sequence[BlockHash], prompt_tokens: int, block_size: int,
    rng: random.Random, overlap_weight: float = 1.0,
) -> Choice:
    """The decode instance with the least work for this request, in KV blocks (Dynamo's
    KV-router cost, prefill's): overlap_weight x the prompt's blocks it does not hold (it
    computes or loads them if the prompt is computed there), plus the blocks its
    requests hold (each decode step reads them all), plus this prompt's blocks for each
    request waiting there or sent to it since its last heartbeat (not yet in its blocks)."""
    if not candidates:
        raise LookupError("no live decode instance")
    total = prompt_blocks(prompt_tokens, block_size)
    held = {c.instance_id: leading_blocks_held(c, hashes) for c in candidates}

    def cost(c: Instance) -> float:
        used = c.load.num_total_kv_blocks - c.load.num_free_kv_blocks
        queued = c.load.num_waiting + c.in_flight
        return float(overlap_weight * max(total - held[c.instance_id], 0) + used + queued * total)

    costs = {c.instance_id: cost(c) for c in candidates}
    inst = _pick(candidates, lambda c: costs[c.instance_id], rng)
    return Choice(inst, "kv_cost", costs, held)


@dataclass(slots=True)
class PrefillSite:
    """Where a request's prompt is computed: on a prefill instance (disaggregated) or
    on its decode instance (local), and why."""

    local: bool
    reason: str
    queued_tokens: int
    """The least loaded prefill instance's queue, in prompt tokens (-1: none live)."""


def queued_prefill_tokens(inst: Instance) -> int:
    """Prompt tokens queued on the instance (the whole prompts of its requests not past
    prefill, cached or not: queued_prompt_tokens): its last heartbeat's, plus what this
    balancer sent it since."""
    return inst.load.num_queued_tokens + inst.in_flight_tokens


def conditional_disaggregation(max_local_tokens: int, max_queue_tokens: int) -> bool:
    """Whether a prompt may be computed on its decode instance (either rule on)."""
    return max_local_tokens > 0 or max_queue_tokens > 0


def choose_prefill_site(
    candidates: Sequence[Instance], hashes: Sequence[BlockHash], prompt_tokens: int, block_size: int,
    max_local_tokens: int, max_queue_tokens: int, decode: Instance | None = None,
) -> PrefillSite:
    """Dynamo's conditional disaggregation. A prompt is prefilled on its decode instance
    when what is left to compute (beyond the longest prefix a prefill instance, whose
    blocks kvcache holds too, or the decode instance itself holds) is short (at most
    max_local_tokens), or when prefill is the bottleneck (the least loaded prefill
    instance has max_queue_tokens queued): then decode folds the prompt into its own
    steps, its decoding requests riding along. With either rule on, also when no
    prefill instance is live. 0 turns a rule off; with both off, always remote."""
    if not conditional_disaggregation(max_local_tokens, max_queue_tokens):
        return PrefillSite(False, "disaggregated", -1)
    if not candidates:
        return PrefillSite(True, "no_prefill_instance", -1)
    holders = [*candidates, decode] if decode is not None else candidates
    held = max(leading_blocks_held(c, hashes) for c in holders)
    to_compute = prompt_tokens - held * block_size
    queued = min(queued_prefill_tokens(c) for c in candidates)
    if 0 < max_local_tokens and to_compute <= max_local_tokens:
        return PrefillSite(True, "short_prompt", queued)
    if 0 < max_queue_tokens <= queued:
        return PrefillSite(True, "prefill_queue", queued)
    return PrefillSite(False, "disaggregated", queued)


def encode_on_prefill(
    image_tokens: Sequence[int], image_hashes: Sequence[bytes], candidates: Sequence[Instance], max_tokens: int
) -> bool:
    """Whether prefill should encode the request's images itself rather than send them to
    a vision instance: one image only, of at most max_tokens tokens (its merged patches:
    the tower's work grows with them, the round trip's does not), held by no candidate's
    embedding cache (a holder answers from memory with no encode at all). max_tokens 0:
    never (every image goes to the vision stage)."""
    if max_tokens <= 0 or len(image_tokens) != 1 or image_tokens[0] > max_tokens:
        return False
    return not any(h in c.images for c in candidates for h in image_hashes)


def choose_vision(candidates: Sequence[Instance], image_hashes: Sequence[bytes], rng: random.Random) -> Choice:
    """The vision instance with the least image work for this request: the request's
    images its cache does not hold (each an encode there) plus the images waiting or
    in its tower, and those sent to it since its last heartbeat. An instance holding
    them all wins unless it is busier by more than the request's images."""
    if not candidates:
        raise LookupError("no live vision instance")
    wanted = set(image_hashes)

    def cost(c: Instance) -> float:
        return float(len(wanted - c.images) + c.load.num_running + c.load.num_waiting + c.in_flight)

    costs = {c.instance_id: cost(c) for c in candidates}
    inst = _pick(candidates, lambda c: costs[c.instance_id], rng)
    held = len(wanted & inst.images)
    return Choice(inst, "cache_affinity" if held else "least_loaded", costs)
