"""The vision stage's parts that decide alone: the balancer's vision policy (cache
affinity from heartbeats against load) and a vision instance's two-tier embedding cache."""

import random

import pytest
import torch

from services.balancer.router.policies import choose_vision, encode_on_prefill
from services.balancer.router.registry import Registry
from services.vision.cache import EmbeddingCache
from tests.helpers.clock import Clock
from tests.helpers.vision_heartbeats import beat

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def test_vision_goes_to_the_instance_holding_the_images_unless_it_is_busier_than_they_cost() -> None:
    reg = Registry(clock=Clock())
    beat(reg, "v0", [A, B])
    beat(reg, "v1", [])
    rng = random.Random(0)
    choice = choose_vision(reg.live("vision"), [A, B], rng)
    assert (choice.instance.instance_id, choice.reason) == ("v0", "cache_affinity")
    assert choice.scores == {"v0": 0.0, "v1": 2.0}
    beat(reg, "v0", [A, B], running=2, waiting=1)  # 3 images of work there, 2 encodes here
    assert choose_vision(reg.live("vision"), [A, B], rng).instance.instance_id == "v1"
    # Nobody holds C: the least loaded; no live instance is a LookupError.
    choice = choose_vision(reg.live("vision"), [C], rng)
    assert (choice.instance.instance_id, choice.reason) == ("v1", "least_loaded")
    with pytest.raises(LookupError):
        choose_vision([], [C], rng)


def test_a_lone_small_image_no_instance_holds_is_encoded_on_prefill() -> None:
    reg = Registry(clock=Clock())
    beat(reg, "v0", [A])
    beat(reg, "v1", [])
    live = reg.live("vision")
    assert encode_on_prefill([64], [C], live, max_tokens=64)  # at the limit: prefill
    assert not encode_on_prefill([65], [C], live, max_tokens=64)  # past it: the vision stage
    assert not encode_on_prefill([4, 4], [B, C], live, max_tokens=64)  # two images: the vision stage batches them
    assert not encode_on_prefill([4], [A], live, max_tokens=64)  # v0 holds it: no encode at all there
    assert not encode_on_prefill([4], [C], live, max_tokens=0)  # the default: the crossover is off
    assert encode_on_prefill([4], [A], [], max_tokens=64)  # nobody live holds it


def test_the_cache_moves_the_least_recently_used_to_host_then_drops_them() -> None:
    row = torch.zeros(4, 4)  # 64 bytes
    cache = EmbeddingCache(device_bytes=128, host_bytes=64)
    cache.put(A, row.clone(), (1, 2, 2))
    cache.put(B, row.clone(), (1, 2, 2))
    assert cache.get(A) is not None  # A is now the most recently used
    cache.put(C, row.clone(), (1, 2, 2))  # 192 device bytes: B (least recent) moves to host
    assert (cache.used_device, cache.used_host) == (128, 64)
    assert not cache.get(B).on_device and cache.get(A).on_device
    assert cache.recent(2) == [A, B]  # the gets above: A, then B, most recently used
    # D: C (now the least recently used) moves to host, which is then over its 64 bytes:
    # C, its least recently used, goes; B, used more recently, stays.
    cache.put(b"d" * 32, row.clone(), (1, 2, 2))
    assert C not in cache and B in cache and len(cache) == 3
    assert (cache.used_device, cache.used_host) == (128, 64)
