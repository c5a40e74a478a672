"""The routing rule: which replica should run a prompt (its prefill, or its decode).

A small pure function over plain facts, unit-tested without a cluster:

- `load`: the least loaded candidate (ties: the lowest id).
- `cache-aware`: the candidate with the longest cached prefix of the prompt, unless its load is
  more than `max_load` over the least loaded candidate's — then, and when no candidate holds any
  of the prefix, the least loaded one. Among candidates with equally long prefixes the least
  loaded wins. The bound is relative: a prefix every prompt shares (a system prompt) would
  otherwise draw every prompt to the first replica that cached it while the others stand idle.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.types import ReplicaId


class Routing(enum.Enum):
    """How the router picks a replica for a prompt (`--routing`)."""

    CACHE_AWARE = "cache-aware"
    LOAD = "load"


@dataclass(frozen=True)
class Candidate:
    """One replica that could take the prompt: how much of it it holds and how loaded it is."""

    replica: ReplicaId
    cached_pages: int  # longest prefix of the prompt's full pages it is believed to hold
    load: int  # requests it runs or holds pages for


def choose(candidates: Sequence[Candidate], routing: Routing, max_load: int) -> Candidate | None:
    """The candidate the prompt should go to (None when there is none)."""
    if not candidates:
        return None
    least_loaded = min(candidates, key=lambda c: (c.load, c.replica))
    if routing is Routing.LOAD:
        return least_loaded
    bound = least_loaded.load + max_load
    eligible = [c for c in candidates if c.load <= bound and c.cached_pages > 0]
    if not eligible:
        return least_loaded
    return min(eligible, key=lambda c: (-c.cached_pages, c.load, c.replica))
