"""Per-step seeds (pure Python): a request's step n draws from a seed made of (request seed, n).

Shared by the torch samplers and the simulated engine's token choice, so each reproduces a request's
tokens whatever batch it shares and whichever replica runs it. `race_bits` is the pure-Python
reference of the device sampler's counter hash (`device_sampling.race_noise` computes the same bits
with int64 tensor ops).
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
# Weyl step (2^32 / golden ratio, odd): vocabulary index i → i * WEYL32 mod 2^32 is a bijection, and
# i * WEYL32 < 2^63 for every index below 2^31
WEYL32 = 0x9E3779B9
# a two-round 32-bit finaliser (shifts 16, 15, 15; odd multipliers from Wellons' hash prospector). Both
# multipliers are below 2^31, so a 32-bit value times either stays below 2^63: the int64 tensor version
# never overflows, and masking to 32 bits gives the product mod 2^32.
MIX32 = (0x21F0AAAD, 0x735A2D97)


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 64-bit seed for (request seed, step) (splitmix64 finaliser)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def race_bits(seed64: int, index: int) -> int:
    """32 well-mixed bits for vocabulary entry `index` (< 2^31) under the 64-bit step seed `seed64`.

    The low half of the seed is added to, the high half xored into, the index's Weyl value, then two
    multiply-xorshift rounds mix it; every intermediate value stays below 2^63."""
    x = ((((index * WEYL32) & MASK32) ^ (seed64 >> 32)) + (seed64 & MASK32)) & MASK32
    x ^= x >> 16
    x = (x * MIX32[0]) & MASK32
    x ^= x >> 15
    x = (x * MIX32[1]) & MASK32
    return x ^ (x >> 15)
