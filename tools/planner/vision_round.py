"""One round of the vision stage for `infermesh profile`: `concurrency` chats sent at
once through the balancer's OpenAI API, each with one image no cache holds (seeded
noise, the round's salt mixed in, so neither a vision instance's embedding cache nor
kvcache has it) and max_tokens 1. The figures come off the balancer's /metrics,
differenced over the round (services/balancer/router/vision.py's series):

latency_ms    the mean time from asking a vision instance to its reply that the
              images are encoded and stored (vision_encode_seconds' sum over count);
images_per_s  images the vision stage encoded over the seconds in which at least one
              ask was out (vision_images_total{site=vision} over
              vision_busy_seconds_total): the stage's rate with the round's images in
              flight, prefill's time not in it (prefill runs after the reply).

One vision instance in the mesh gives one instance's figures (the profile's); with
more, the stage's. A round in which no image reached a vision instance (none live,
vision.enabled off, or an image under vision.prefill_max_image_tokens left to
prefill) fails, naming why: its figures would be prefill's.
"""

import asyncio
import base64
import hashlib
import io
from dataclasses import dataclass

import httpx
import numpy as np

from tools.planner.mesh_facts import Samples, parse_samples, series_sum
from tools.planner.points import RoundFailed

IMAGES = "infermesh_balancer_vision_images_total"
ENCODE_SECONDS = "infermesh_balancer_vision_encode_seconds"
BUSY_SECONDS = "infermesh_balancer_vision_busy_seconds_total"


@dataclass(frozen=True, slots=True)
class VisionRound:
    latency_ms: float
    images_per_s: float
    wall_s: float


def image_url(side: int, seed: int, salt: str) -> str:
    """A PNG data URL of a side x side RGB noise image, unique to (seed, salt)."""
    from PIL import Image

    key = int.from_bytes(hashlib.sha256(f"{seed}/{salt}".encode()).digest()[:8], "little")
    pixels = np.random.default_rng(key).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def vision_figures(before: Samples, after: Samples, wall_s: float) -> VisionRound:
    """The round's figures from the balancer's series before and after it."""
    def delta(name: str, **labels: str) -> float:
        want = set(labels.items())
        return (sum(v for (n, ls), v in after.items() if n == name and want <= ls)
                - sum(v for (n, ls), v in before.items() if n == name and want <= ls))

    encoded, busy = delta(IMAGES, site="vision"), delta(BUSY_SECONDS)
    asks = series_sum(after, f"{ENCODE_SECONDS}_count") - series_sum(before, f"{ENCODE_SECONDS}_count")
    if encoded <= 0 or asks <= 0 or busy <= 0:
        elsewhere = delta(IMAGES) - encoded
        raise RoundFailed(f"no image of the round was encoded by a vision instance ({elsewhere:g} by prefill: "
                          "none live, vision.enabled off, or under vision.prefill_max_image_tokens)")
    latency_s = (series_sum(after, f"{ENCODE_SECONDS}_sum") - series_sum(before, f"{ENCODE_SECONDS}_sum")) / asks
    return VisionRound(latency_s * 1e3, encoded / busy, wall_s)


async def vision_round(client: httpx.AsyncClient, metrics_url: str, model: str, concurrency: int, side: int,
                       seed: int, salt: str) -> VisionRound:  # fmt: skip
    """client: the balancer's /v1; metrics_url: its /metrics."""
    bodies = [{"model": model, "max_tokens": 1, "temperature": 0.0, "cache_salt": f"{salt}-{i}",
               "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": image_url(side, seed, f"{salt}-{i}")}},
                   {"type": "text", "text": "Describe the image."}]}]}
              for i in range(concurrency)]  # fmt: skip
    before = await _scrape(client, metrics_url)
    loop = asyncio.get_running_loop()
    start = loop.time()
    responses = await asyncio.gather(*(client.post("/chat/completions", json=b) for b in bodies))
    wall = loop.time() - start
    failed = [r for r in responses if r.status_code != 200]
    if failed:
        raise RoundFailed(f"{len(failed)} of {len(responses)} image chats failed, e.g. HTTP "
                          f"{failed[0].status_code}: {failed[0].text[:200]}")
    return vision_figures(before, await _scrape(client, metrics_url), wall)


async def _scrape(client: httpx.AsyncClient, url: str) -> Samples:
    return parse_samples((await client.get(url)).raise_for_status().text)
