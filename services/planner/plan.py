"""`infermesh plan`'s core: a profile, a workload, latency targets and a GPU-hour price
in; replicas per stage, predicted latencies and the price of each token class out.
Pure arithmetic over services/planner/stage_model.py, so the CLI, the simulator and
the live planner size the mesh by one rule.

The sizing rule (Dynamo's SLA planner, with our profile):

- prefill replicas = ceil(requests/s x mean uncached input tokens / T_p), where T_p
  is the uncached tokens/s of one instance at the highest-throughput concurrency
  whose TTFT, at the target percentile's uncached length, fits the TTFT target less
  the encoder's latency, the time to load the cached prefix and the handoff's (the
  percentile's whole prompt of KV at the profile's handoff_gb_s: the profile's
  prefill TTFT is measured without a handoff; 0 where the rate was not measured);
- decode replicas = ceil(requests/s x mean output tokens / T_d), where T_d is the
  best output tokens/s of one instance whose ITL meets the target at the percentile's
  context (input + half the output: the mean context over a request's decode);
- vision replicas = ceil(requests/s x images per request / images/s of one encoder at
  the chosen concurrency); the encoder's point and prefill's are chosen together for
  the fewest GPUs that keep the TTFT target (an encoder at concurrency c adds its
  latency L_c to every TTFT and takes images at R_c per second: the planner weighs a
  slow, batched encoder point, fewer encoders, against the prompt time it leaves
  prefill). Where even the fastest encoder point leaves no TTFT budget, the plan is
  infeasible and names the vision stage.

A percentile of latency is read as the latency at that percentile of length: TTFT and
ITL rise with length, so the p-th percentile request is the p-th percentile length
(the profile's points are medians; spread at one length is not modelled).

Cost (the allocation rule): each stage's GPUs are paid for whole, idle headroom
included, and charged to the token classes by the busy time each class gives that
stage: decode's GPUs to output tokens; vision's to uncached input (images are
uncached input); prefill's split between uncached input (tokens / T_p) and cache-hit
input (the time to load their KV at the profile's kvcache rate). Without a measured
kvcache rate a cache hit is charged nothing, and the plan's notes say so.

A target that cannot be met raises InfeasibleTarget naming it and the best the
profile achieves: the plan never relaxes a target.
"""

import math
from dataclasses import dataclass, field

from services.planner.profile import Profile
from services.planner.stage_model import (
    DecodeOperating,
    PrefillOperating,
    StageModels,
    VisionOperating,
)

TOKEN_CLASSES = ("cache_hit_input", "uncached_input", "output")


@dataclass(frozen=True, slots=True)
class Lengths:
    """A token-length distribution: its mean, and a p90 or samples for its percentiles."""

    mean: float
    p90: float | None = None
    samples: tuple[int, ...] = ()

    @classmethod
    def of_samples(cls, samples: "list[int] | tuple[int, ...]") -> "Lengths":
        if not samples:
            raise ValueError("Lengths.of_samples needs at least one sample")
        return cls(mean=sum(samples) / len(samples), samples=tuple(sorted(samples)))

    def quantile(self, percentile: float) -> float:
        if self.samples:
            rank = max(math.ceil(percentile / 100 * len(self.samples)) - 1, 0)  # nearest rank
            return float(self.samples[rank])
        if self.p90 is None:
            return self.mean  # every request the same length
        if percentile == 90:
            return self.p90
        raise ValueError(f"only a p90 is given for this length: give samples to plan for p{percentile:g}")


@dataclass(frozen=True, slots=True)
class Workload:
    requests_per_s: float
    input_tokens: Lengths
    output_tokens: Lengths
    prefix_hit_rate: float = 0.0
    """Share of input tokens whose KV is already cached (kvcache or an engine)."""
    images_per_request: float = 0.0
    image_px: int | None = None
    """The images' side in pixels (square, or the square of as many pixels): the encoder's
    figures are read at it (stage_model.VisionModel); None: the largest size profiled."""

    def __post_init__(self) -> None:
        if self.requests_per_s <= 0:
            raise ValueError(f"requests_per_s must be > 0, got {self.requests_per_s}")
        if not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")
        if self.images_per_request < 0:
            raise ValueError(f"images_per_request must be >= 0, got {self.images_per_request}")


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_ms: float
    itl_ms: float
    percentile: float = 90.0


class InfeasibleTarget(ValueError):
    """A target no allocation of this profile meets; `best_ms` is the best it achieves;
    `stage` the stage that cannot meet it (prefill, decode, or vision where the encoder
    alone takes the TTFT budget)."""

    def __init__(self, target: str, target_ms: float, best_ms: float, why: str, stage: str = "") -> None:
        self.target, self.target_ms, self.best_ms, self.stage = target, target_ms, best_ms, stage
        super().__init__(f"{target} target {target_ms:g} ms cannot be met: the best this profile achieves is "
                         f"{best_ms:.1f} ms ({why})")


@dataclass(frozen=True, slots=True)
class TokenClass:
    tokens_per_hour: float
    gpus_charged: float
    """GPUs (of the whole plan) whose cost falls on this class."""
    tokens_per_gpu_hour: float
    """This class's tokens per GPU-hour of the whole plan (DeepSeek's convention)."""
    usd_per_million: float | None
    """None where the class has no tokens."""


@dataclass(frozen=True)
class Plan:
    replicas: dict[str, int]
    gpus: dict[str, int]
    prefill: PrefillOperating
    """Where each prefill instance runs at the planned load."""
    decode: DecodeOperating
    vision: VisionOperating | None
    predicted_ttft_ms: float
    predicted_itl_ms: float
    kv_load_ms: float
    classes: dict[str, TokenClass]
    usd_per_hour: float
    usd_per_million_blended: float
    notes: list[str] = field(default_factory=list)
    handoff_ms: float = 0.0
    """The percentile's prompt KV handed from prefill to decode, in the predicted TTFT."""

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus.values())


@dataclass(frozen=True, slots=True)
class _Shape:
    """The workload's lengths as the stages see them."""

    uncached_p: float
    uncached_mean: float
    hit_mean: float
    context_p: float
    context_mean: float


def _shape(workload: Workload, percentile: float) -> _Shape:
    miss = 1.0 - workload.prefix_hit_rate
    isl_p, isl_mean = workload.input_tokens.quantile(percentile), workload.input_tokens.mean
    osl_p, osl_mean = workload.output_tokens.quantile(percentile), workload.output_tokens.mean
    return _Shape(uncached_p=isl_p * miss, uncached_mean=isl_mean * miss, hit_mean=isl_mean * workload.prefix_hit_rate,
                  context_p=isl_p + osl_p / 2, context_mean=isl_mean + osl_mean / 2)


def _kv_load_s(profile: Profile, hit_tokens: float) -> float | None:
    rates = profile.transfer
    if hit_tokens <= 0:
        return 0.0
    if rates.kvcache_gb_s is None or rates.kv_bytes_per_token is None:
        return None
    return hit_tokens * rates.kv_bytes_per_token / (rates.kvcache_gb_s * 1e9)


def _handoff_s(profile: Profile, prompt_tokens: float) -> float | None:
    """The prefill -> decode handoff of a prompt's KV; None where the profile has no rate."""
    rates = profile.transfer
    if rates.handoff_gb_s is None or rates.kv_bytes_per_token is None:
        return None
    return prompt_tokens * rates.kv_bytes_per_token / (rates.handoff_gb_s * 1e9)


def plan(profile: Profile, workload: Workload, targets: Targets, gpu_hour_usd: float) -> Plan:
    models = StageModels.from_profile(profile)
    shape = _shape(workload, targets.percentile)
    rps, notes = workload.requests_per_s, []
    per = profile.devices_per_instance

    load_s = _kv_load_s(profile, workload.input_tokens.quantile(targets.percentile) * workload.prefix_hit_rate)
    if load_s is None:
        notes.append("cache-hit load time not in the profile (transfer.kvcache_gb_s, kv_bytes_per_token): "
                     "counted as 0 ms and cache-hit input charged nothing")
        load_s = 0.0
    handoff_s = _handoff_s(profile, workload.input_tokens.quantile(targets.percentile))
    if handoff_s is None:
        notes.append("handoff time not in the profile (transfer.handoff_gb_s): counted as 0 ms")
        handoff_s = 0.0
    # Both on every TTFT path before decode's first token: one budget item (kv_load_ms reports the load alone).
    kv_load_ms, handoff_ms = load_s * 1000, handoff_s * 1000
    fixed_ms = kv_load_ms + handoff_ms

    # Decode: Dynamo's rule, independent of the other stages.
    decode_op = models.decode.max_load(shape.context_p, shape.context_mean, targets.itl_ms)
    if decode_op is None:
        raise InfeasibleTarget("ITL", targets.itl_ms, models.decode.best_itl_ms(shape.context_p),
                               f"p{targets.percentile:g} context {shape.context_p:.0f} tokens at the smallest batch",
                               stage="decode")
    decode_replicas = max(1, math.ceil(rps * workload.output_tokens.mean / decode_op.tokens_per_s))

    # Prefill and vision together: each encoder point leaves prefill a TTFT budget.
    vision_options: list[VisionOperating | None] = [None]
    if workload.images_per_request > 0:
        encoders = models.vision.operating_points(workload.image_px)
        if not encoders:
            raise ValueError("the workload has images but the profile has no vision points")
        vision_options = list(encoders)
        fastest = min(encoders, key=lambda v: v.latency_ms)
        if fastest.latency_ms + fixed_ms >= targets.ttft_ms:  # no prompt time left at any encoder point
            raise InfeasibleTarget("TTFT", targets.ttft_ms,
                                   fastest.latency_ms + fixed_ms + models.prefill.best_ttft_ms(shape.uncached_p),
                                   f"the vision encoder alone takes {fastest.latency_ms:.1f} ms at its fastest "
                                   f"(concurrency {fastest.concurrency}), + {kv_load_ms:.1f} ms cache load "
                                   f"+ {handoff_ms:.1f} ms handoff",
                                   stage="vision")
    best: tuple[int, float, PrefillOperating, int, VisionOperating | None, int] | None = None
    for vision_op in vision_options:
        vision_ms = 0.0 if vision_op is None else vision_op.latency_ms
        op = models.prefill.max_load(shape.uncached_p, shape.uncached_mean, targets.ttft_ms - vision_ms - fixed_ms)
        if op is None:
            continue
        prefill_replicas = max(1, math.ceil(rps * shape.uncached_mean / op.tokens_per_s))
        vision_replicas = (0 if vision_op is None
                           else math.ceil(rps * workload.images_per_request / vision_op.images_per_s))
        gpus = prefill_replicas * per.get("prefill", 1) + vision_replicas * per.get("vision", 1)
        key = (gpus, op.ttft_ms + vision_ms)
        if best is None or key < best[:2]:
            best = (gpus, op.ttft_ms + vision_ms, op, prefill_replicas, vision_op, vision_replicas)
    if best is None:
        fastest_vision = min((v.latency_ms for v in vision_options if v is not None), default=0.0)
        raise InfeasibleTarget("TTFT", targets.ttft_ms,
                               models.prefill.best_ttft_ms(shape.uncached_p) + fastest_vision + fixed_ms,
                               f"p{targets.percentile:g} uncached prompt {shape.uncached_p:.0f} tokens alone on an "
                               f"instance, + {kv_load_ms:.1f} ms cache load + {handoff_ms:.1f} ms handoff "
                               f"+ {fastest_vision:.1f} ms encoder",
                               stage="prefill")
    _, _, prefill_max, prefill_replicas, vision_op, vision_replicas = best

    # Where instances actually run: the planned load spread over the replicas (ceil leaves slack).
    prefill_at = models.prefill.at_load(shape.uncached_p, shape.uncached_mean,
                                        rps * shape.uncached_mean / prefill_replicas)
    decode_at = models.decode.at_load(shape.context_p, shape.context_mean,
                                      rps * workload.output_tokens.mean / decode_replicas)
    assert prefill_at is not None and decode_at is not None, "the load per replica is within the chosen operating point"
    vision_ms = 0.0 if vision_op is None else vision_op.latency_ms

    replicas = {"prefill": prefill_replicas, "decode": decode_replicas, "vision": vision_replicas}
    gpus = {stage: n * per.get(stage, 1) for stage, n in replicas.items()}
    classes = _price(workload, shape, gpus, prefill_max, _kv_load_s(profile, shape.hit_mean) or 0.0, gpu_hour_usd)
    total_gpus = sum(gpus.values())
    tokens_per_hour = sum(c.tokens_per_hour for c in classes.values())
    return Plan(replicas=replicas, gpus=gpus, prefill=prefill_at, decode=decode_at, vision=vision_op,
                predicted_ttft_ms=prefill_at.ttft_ms + vision_ms + fixed_ms, predicted_itl_ms=decode_at.itl_ms,
                kv_load_ms=kv_load_ms, classes=classes, usd_per_hour=total_gpus * gpu_hour_usd,
                usd_per_million_blended=total_gpus * gpu_hour_usd * 1e6 / tokens_per_hour, notes=notes,
                handoff_ms=handoff_ms)


def _price(workload: Workload, shape: _Shape, gpus: dict[str, int], prefill_op: PrefillOperating,
           hit_load_s_per_request: float, gpu_hour_usd: float) -> dict[str, TokenClass]:
    """The allocation rule in the module docstring. Busy time is in instance-seconds
    per second of wall time; only its ratio within the prefill stage matters."""
    rps = workload.requests_per_s
    uncached_busy = rps * shape.uncached_mean / prefill_op.tokens_per_s
    hit_busy = rps * hit_load_s_per_request
    prefill_busy = uncached_busy + hit_busy
    hit_share = hit_busy / prefill_busy if prefill_busy > 0 else 0.0
    charged = {
        "cache_hit_input": gpus["prefill"] * hit_share,
        "uncached_input": gpus["prefill"] * (1 - hit_share) + gpus["vision"],
        "output": float(gpus["decode"]),
    }
    tokens = {
        "cache_hit_input": rps * shape.hit_mean * 3600,
        "uncached_input": rps * shape.uncached_mean * 3600,
        "output": rps * workload.output_tokens.mean * 3600,
    }
    total = sum(gpus.values())
    return {name: TokenClass(tokens_per_hour=tokens[name], gpus_charged=charged[name],
                             tokens_per_gpu_hour=tokens[name] / total,
                             usd_per_million=(charged[name] * gpu_hour_usd * 1e6 / tokens[name]
                                              if tokens[name] else None))
            for name in TOKEN_CLASSES}
