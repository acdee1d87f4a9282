"""Per-stage performance models read off a profile: what one instance of a stage does
at an operating point the sweep did not measure, and the most load it takes while a
latency target holds. `plan` sizes the mesh with them; the simulator's "true" system
and the live planner reuse them, so every part agrees on one reading of a profile.

How a profile is read (the rule `infermesh plan` documents):

- Between measured points, values are interpolated in log-log space (log value
  against log tokens, log concurrency or log batch): latency and throughput curves
  are close to power laws over the swept ranges, and a straight line in log space
  neither overshoots nor goes negative.
- Beyond the longest or below the shortest measured length (prompt tokens, decode
  context), values are extrapolated *linearly in tokens* from the end segment: past
  the sweep, prefill time grows about linearly with the tokens computed and decode's
  KV read with the context. An extrapolation that would reach zero or below falls
  back to proportional scaling from the end point.
- Concurrency and batch are never extrapolated: an instance is only credited with
  loads the sweep showed it taking (a batch past the measured one may not fit its KV
  memory). A value asked for beyond them raises ValueError.
"""

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.planner.profile import DecodePoint, PrefillPoint, Profile, VisionPoint


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at x from points (xs ascending, distinct, ys > 0): log-log inside, linear in x outside."""
    if len(xs) != len(ys) or not xs:
        raise ValueError("interpolate needs as many ys as xs, at least one")
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional (a lone length says nothing about the offset)
    if xs[0] <= x <= xs[-1]:
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    (x0, y0), (x1, y1) = ((xs[0], ys[0]), (xs[1], ys[1])) if x < xs[0] else ((xs[-2], ys[-2]), (xs[-1], ys[-1]))
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if y > 0:
        return y
    end_x, end_y = (x0, y0) if x < xs[0] else (x1, y1)
    return end_y * x / end_x


def _between_levels(levels: Sequence[int], values: Sequence[float], level: float, what: str) -> float:
    """Log-log interpolation across measured concurrencies or batches; never beyond them."""
    if not levels[0] <= level <= levels[-1]:
        raise ValueError(f"{what} {level} is outside the profile's measured {levels[0]}..{levels[-1]}")
    return interpolate(levels, values, level)


def _least_level(levels: Sequence[int], rate: Callable[[float], float], demand: float) -> float | None:
    """The least level (continuous, by bisection) in the measured range whose rate
    covers the demand; the lowest level when even it does; None when the top does not."""
    low, high = float(levels[0]), float(levels[-1])
    if rate(low) >= demand:
        return low
    if rate(high) < demand:
        return None
    for _ in range(40):  # rate is monotone in the level between measured points: bisection converges
        mid = (low + high) / 2
        low, high = (mid, high) if rate(mid) < demand else (low, mid)
    return high


@dataclass(frozen=True, slots=True)
class PrefillOperating:
    """One prefill instance held at `concurrency` prompts in flight."""

    concurrency: float
    ttft_ms: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class DecodeOperating:
    """One decode instance holding `batch` requests at once."""

    batch: float
    itl_ms: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class VisionOperating:
    concurrency: int
    latency_ms: float
    images_per_s: float


class PrefillModel:
    """TTFT and uncached tokens/s of one instance against uncached length and concurrency."""

    def __init__(self, points: Sequence[PrefillPoint]) -> None:
        by_level: dict[int, list[PrefillPoint]] = {}
        for p in points:
            by_level.setdefault(p.concurrency, []).append(p)
        if not by_level:
            raise ValueError("the profile has no prefill points")
        self.levels = sorted(by_level)
        self._curves = {c: sorted(ps, key=lambda p: p.input_tokens) for c, ps in by_level.items()}

    def _at(self, field: str, input_tokens: float, concurrency: float) -> float:
        per_level = []
        for c in self.levels:
            curve = self._curves[c]
            per_level.append(interpolate([p.input_tokens for p in curve], [getattr(p, field) for p in curve],
                                         input_tokens))
        return _between_levels(self.levels, per_level, concurrency, "prefill concurrency")

    def ttft_ms(self, input_tokens: float, concurrency: float = 1) -> float:
        return self._at("ttft_ms", max(input_tokens, 1.0), concurrency)

    def tokens_per_s(self, input_tokens: float, concurrency: float = 1) -> float:
        return self._at("tokens_per_s", max(input_tokens, 1.0), concurrency)

    def best_ttft_ms(self, input_tokens: float) -> float:
        """The lowest TTFT the profile shows at this length (one prompt alone, as a rule)."""
        return min(self.ttft_ms(input_tokens, c) for c in self.levels)

    def operating_points(self, latency_tokens: float, rate_tokens: float) -> list[PrefillOperating]:
        """Each whole concurrency in the measured range: TTFT at `latency_tokens` (the
        length at the target's percentile), throughput at `rate_tokens` (the mean)."""
        return [PrefillOperating(c, self.ttft_ms(latency_tokens, c), self.tokens_per_s(rate_tokens, c))
                for c in range(self.levels[0], self.levels[-1] + 1)]

    def at_load(self, latency_tokens: float, rate_tokens: float, demand_tokens_per_s: float) -> PrefillOperating | None:
        """Where an instance settles when asked for `demand_tokens_per_s`: the least
        concurrency whose throughput covers it (throughput rises with concurrency), so its
        TTFT there. None when the demand is past the most the profile measured."""
        c = _least_level(self.levels, lambda c: self.tokens_per_s(rate_tokens, c), demand_tokens_per_s)
        if c is None:
            return None
        return PrefillOperating(c, self.ttft_ms(latency_tokens, c), self.tokens_per_s(rate_tokens, c))

    def max_load(self, latency_tokens: float, rate_tokens: float, ttft_budget_ms: float) -> PrefillOperating | None:
        """The highest-throughput operating point whose TTFT fits the budget; None if none does."""
        fits = [op for op in self.operating_points(latency_tokens, rate_tokens) if op.ttft_ms <= ttft_budget_ms]
        return max(fits, key=lambda op: op.tokens_per_s, default=None)


class DecodeModel:
    """ITL and output tokens/s of one instance against batch and context."""

    def __init__(self, points: Sequence[DecodePoint]) -> None:
        by_batch: dict[int, list[DecodePoint]] = {}
        for p in points:
            by_batch.setdefault(p.batch, []).append(p)
        if not by_batch:
            raise ValueError("the profile has no decode points")
        self.batches = sorted(by_batch)
        self._curves = {b: sorted(ps, key=lambda p: p.context_tokens) for b, ps in by_batch.items()}

    def _at(self, field: str, batch: float, context_tokens: float) -> float:
        per_batch = []
        for b in self.batches:
            curve = self._curves[b]
            per_batch.append(interpolate([p.context_tokens for p in curve], [getattr(p, field) for p in curve],
                                         max(context_tokens, 1.0)))
        return _between_levels(self.batches, per_batch, batch, "decode batch")

    def itl_ms(self, batch: float, context_tokens: float) -> float:
        return self._at("itl_ms", batch, context_tokens)

    def tokens_per_s(self, batch: float, context_tokens: float) -> float:
        return self._at("tokens_per_s", batch, context_tokens)

    def best_itl_ms(self, context_tokens: float) -> float:
        return min(self.itl_ms(b, context_tokens) for b in self.batches)

    def at_load(self, latency_context: float, rate_context: float, demand_tokens_per_s: float) -> DecodeOperating | None:
        """The least batch whose output rate covers the demand, and its ITL; None past the profile."""
        b = _least_level(self.batches, lambda b: self.tokens_per_s(b, rate_context), demand_tokens_per_s)
        if b is None:
            return None
        return DecodeOperating(b, self.itl_ms(b, latency_context), self.tokens_per_s(b, rate_context))

    def max_load(self, latency_context: float, rate_context: float, itl_target_ms: float) -> DecodeOperating | None:
        """Dynamo's rule: the best throughput per instance whose ITL meets the target at
        the workload's context (ITL at the percentile's context, tokens/s at the mean's)."""
        best: DecodeOperating | None = None
        for b in range(self.batches[0], self.batches[-1] + 1):
            itl = self.itl_ms(b, latency_context)
            if itl > itl_target_ms:
                continue
            rate = self.tokens_per_s(b, rate_context)
            if best is None or rate > best.tokens_per_s:
                best = DecodeOperating(b, itl, rate)
        return best


class VisionModel:
    """The encoder: images/s and latency at each measured concurrency and image size.

    At an image size (its side, pixels), each concurrency's latency and seconds per
    image are read against pixels (side squared) by interpolate(): log-log between the
    sizes measured at that concurrency, linear in pixels beyond them (an encoder's work
    grows with its patches). A concurrency measured at one size only, or a profile with
    one size (older profiles), gives its points as measured whatever the size asked.
    No size asked: the largest measured (the cautious reading)."""

    def __init__(self, points: Sequence[VisionPoint]) -> None:
        self.points = sorted(points, key=lambda p: (p.concurrency, p.image_px or 0))
        self.sizes = sorted({p.image_px for p in points if p.image_px is not None})

    def operating_points(self, image_px: float | None = None) -> list[VisionOperating]:
        if image_px is not None and image_px <= 0:
            raise ValueError(f"image size must be positive, got {image_px}")
        side = float(image_px) if image_px is not None else float(self.sizes[-1]) if self.sizes else None
        by_level: dict[int, list[VisionPoint]] = {}
        for p in self.points:
            by_level.setdefault(p.concurrency, []).append(p)
        out = []
        for c, ps in sorted(by_level.items()):
            sized = [p for p in ps if p.image_px is not None]
            if side is None or len(sized) < 2:
                p = min(ps, key=lambda p: abs((p.image_px or 0) - (side or 0)))  # the nearest (the only) size
                out.append(VisionOperating(c, p.latency_ms, p.images_per_s))
                continue
            pixels = [float(p.image_px) ** 2 for p in sized]  # type: ignore[operator]
            latency = interpolate(pixels, [p.latency_ms for p in sized], side**2)
            per_image_s = interpolate(pixels, [1.0 / p.images_per_s for p in sized], side**2)
            out.append(VisionOperating(c, latency, 1.0 / per_image_s))
        return out


@dataclass(frozen=True)
class StageModels:
    prefill: PrefillModel
    decode: DecodeModel
    vision: VisionModel

    @classmethod
    def from_profile(cls, profile: Profile) -> "StageModels":
        return cls(PrefillModel(profile.prefill), DecodeModel(profile.decode), VisionModel(profile.vision))
