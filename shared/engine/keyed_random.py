"""Counter-based randomness for sampling: every random number is a pure function of
(seed, stream, position, index), so no generator state exists to carry anywhere.

A seeded request's token at sequence position P draws its noise from
key(seed, stream, P) alone: whatever the batch around it, whichever process or
device samples it (prefill for the first token, any decode instance after), after
a restart, a handoff or a migration (the continuation's prompt is the old prompt
plus the tokens so far, so positions go on unchanged). The position is the
sequence position, not the output index, for exactly that reason.

The hash is splitmix64's finaliser (Steele et al., "Fast splittable pseudorandom
number generators", 2014) over a Weyl sequence, computed with int64 tensor ops:
multiplication wraps modulo 2**64 on the CPU and in CUDA alike, and right shifts
are made logical by masking, so the 64 random bits per (key, index) are bitwise
the same on any device and equal to the pure-Python `mix64` reference.
"""

from enum import IntEnum

import torch

from shared.engine.step_inputs import to_device

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
"""The Weyl increment (2**64 / golden ratio, odd): consecutive indices land far apart."""
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


class Stream(IntEnum):
    """Independent streams of one request's randomness: the same (seed, position)
    in two streams gives unrelated numbers."""

    TOKEN = 0
    """The race that picks the token at a position (normal sampling, and the draws
    speculative verification matches drafted tokens against). A drafter with a
    proposal that is not one-hot would add streams for its accept tests and its
    residual draws."""


def mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int (the reference the tensor version must match)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _signed(z: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    z &= _MASK64
    return z - (1 << 64) if z >> 63 else z


def row_key(seed: int, position: int, stream: Stream = Stream.TOKEN) -> int:
    """The key of one draw row, as a signed int64: two rounds of mixing, so keys of
    neighbouring seeds or positions share no structure."""
    inner = mix64(seed + _GOLDEN * (int(stream) + 1))
    return _signed(mix64(inner + _GOLDEN * (position + 1)))


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64_t(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lsr(z, 30)) * _signed(_M1)
    z = (z ^ _lsr(z, 27)) * _signed(_M2)
    return z ^ _lsr(z, 31)


def random_bits(keys: torch.Tensor, num: int) -> torch.Tensor:
    """[rows, num] int64: 64 random bits for each (row key, index 0..num-1)."""
    index = torch.arange(1, num + 1, dtype=torch.int64, device=keys.device) * _signed(_GOLDEN)
    return _mix64_t(keys.unsqueeze(1) + index.unsqueeze(0))


def uniforms(keys: torch.Tensor, num: int) -> torch.Tensor:
    """[rows, num] float64 in [0, 1): the top 53 bits, exactly representable."""
    return _lsr(random_bits(keys, num), 11).double() * 2.0**-53


def exponentials(keys: torch.Tensor, num: int) -> torch.Tensor:
    """[rows, num] float64 Exp(1) draws, -log(1 - u): log1p keeps full precision for
    the small values that decide a race (a token with tiny p wins only on tiny q).
    Never exactly 0 after the clamp, so p / q is never 0 / 0."""
    q = -torch.log1p(-uniforms(keys, num))
    return q.clamp_min_(torch.finfo(torch.float64).tiny)


def keys_tensor(seeds: list[int], positions: list[int], stream: Stream, device: torch.device) -> torch.Tensor:
    """[rows] int64 row keys for (seeds[i], positions[i])."""
    return to_device([row_key(s, p, stream) for s, p in zip(seeds, positions, strict=True)], torch.int64, device)


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax(p / q), q ~ Exp(1) keyed per row: a sample of each
    row's distribution (the Gumbel-max trick in another form). probs [rows, vocab],
    need not be normalised (the race is scale-invariant); zero entries never win.
    Returns [rows] int64 token ids on probs' device."""
    q = exponentials(keys, probs.size(1))
    return (probs.double() / q).argmax(dim=-1)
