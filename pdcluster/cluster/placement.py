"""CPU cores of a local cluster's processes: a core of its own for each decode replica's engine thread,
as each would have its own device in a real deployment (`pdcluster up --pin-decode`)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """CPU cores of a local cluster: a core of its own for each decode replica's engine thread."""

    decode: tuple[frozenset[int], ...]  # engine thread of each decode replica, in rank order
    shared: frozenset[int]  # everything else (the decode replicas' other threads and fronts too)

    @classmethod
    def plan(cls, decode: int, cores: set[int] | None = None) -> Placement:
        """The last `decode` cores go one to each decode replica; at least one core stays shared."""
        ordered = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if decode >= len(ordered):
            raise ValueError(f"--pin-decode: {decode} decode replica(s) need more than {len(ordered)} cores")
        own = ordered[len(ordered) - decode:]
        return cls(tuple(frozenset([c]) for c in own), frozenset(ordered[: len(ordered) - decode]))

    def describe(self) -> str:
        """A short text for logs and benchmark summaries."""
        decode = ",".join(str(min(c)) for c in self.decode)
        return f"decode engine threads on cores [{decode}], everything else on {sorted(self.shared)}"

