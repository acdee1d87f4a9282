"""Every sampled output reproducible: a request without `seed` gets one drawn here
before it is dispatched, and every response names the seed it ran with.

The engine keys each draw by (seed, sequence position) (shared/engine/keyed_random.py),
so the seed alone decides the randomness, whichever instances serve the request.
The response carries it twice: `system_fingerprint` ("infermesh-seed-<seed>", on
the whole response and on every stream chunk) and the `x-infermesh-seed` header.
Sending the same request back with `"seed": <seed>` gives the same text (with n > 1,
choice i ran with seed + i, as a seeded request's choices do).
"""

import re
import secrets

SEED_HEADER = "x-infermesh-seed"
FINGERPRINT_PREFIX = "infermesh-seed-"
DRAWN_SEED_LIMIT = 1 << 53
"""Drawn seeds stay below 2**53: a JSON client that reads numbers as doubles
(JavaScript) sends them back unchanged, and seed + i (n choices) stays far below
the engine's limit of 2**63."""


def draw_seed() -> int:
    """A seed for a request that brought none (from the OS's randomness: two
    balancers, or one after a restart, do not repeat each other's)."""
    return secrets.randbelow(DRAWN_SEED_LIMIT)


def fingerprint(seed: int) -> str:
    return f"{FINGERPRINT_PREFIX}{seed}"


def seed_of_fingerprint(value: str) -> int | None:
    """The seed a system_fingerprint names; None for any other string."""
    match = re.fullmatch(re.escape(FINGERPRINT_PREFIX) + r"(\d+)", value)
    return int(match.group(1)) if match else None
