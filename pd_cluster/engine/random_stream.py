"""The counter-based random stream of seeded sampling: 32 random bits from a hash of (the request's
seed, the output position), computed with exact int64 arithmetic (32-bit lanes, no overflow), so
Python ints, CPU tensors and CUDA tensors give the same bits. A node needs only the seed and how
many tokens came before to continue a request's stream: nothing is shipped on a handover or a
retry. :mod:`kernels.sampling` computes the same bits inside its draw."""

from __future__ import annotations

from typing import TypeVar

import torch

_MASK32 = 0xFFFFFFFF
#: Odd multipliers as signed 32-bit values, so ``x * c`` of a 32-bit ``x`` never leaves int64.
_FMIX_C1 = 0x85EBCA6B - 2**32
_FMIX_C2 = 0xC2B2AE35 - 2**32
_GOLDEN = 0x9E3779B1 - 2**32
_SEED_SALT = 0x243F6A88

Int = TypeVar("Int", int, torch.Tensor)


def _mul32(x: Int, c: int) -> Int:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` and ``|c| < 2**31`` (Python int or int64 tensor)."""
    return (x * c) & _MASK32


def _fmix32(h: Int) -> Int:
    """MurmurHash3's finalizer: a bijection of 32-bit values that mixes every bit into every bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def stream_key(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of a seed's stream (computed once per request, on the host)."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    k0 = _fmix32(lo ^ _fmix32(hi ^ _SEED_SALT))
    k1 = _fmix32(hi ^ _fmix32(k0 ^ _SEED_SALT))
    return k0, k1


def random_bits(k0: Int, k1: Int, position: Int) -> Int:
    """32 random bits for output ``position`` of the stream keyed ``(k0, k1)``.

    The same arithmetic on Python ints and on int64 tensors (any device) gives the same bits.
    """
    h = _fmix32(k0 ^ _mul32(position & _MASK32, _GOLDEN))
    return _fmix32(h ^ k1)


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) from 32-bit values (their top 24 bits: exact in float32)."""
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))
