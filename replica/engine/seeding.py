"""Per-step seeds (pure Python): a request's step n draws from a seed made of (request seed, n).

Shared by the torch sampler and the simulated engine's token choice, so both reproduce a request's
tokens whatever batch it shares and whichever replica runs it.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 64-bit seed for (request seed, step) (splitmix64 finaliser)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
