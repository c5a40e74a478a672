"""Step times from a measured profile table (Vidur-style) instead of the roofline model (pure Python).

The table is a CSV with a header `phase,batch_size,context_len,ms`, one row per measurement:

```
 phase,batch_size,context_len,ms
 prefill,1,512,38.1          a prefill of 1 sequence of 512 prompt tokens took 38.1 ms
 prefill,4,512,141.0
 decode,32,1024,21.7         a decode step of 32 sequences whose context is 1024 tokens on average
```
Each phase's rows must form a full grid (every batch size with every context length). A step is
looked up by interpolating linearly in both axes (extrapolating from the last two points past the
edges, never below 0): its prefill sequences (those feeding more than one token, or starting from
nothing) by (count, mean prompt length), its decode sequences by (count, mean context); a step with
both costs the sum. The time is spread evenly over the layers (embed and head cost nothing apart).
"""

from __future__ import annotations

import bisect
import csv
from collections.abc import Sequence
from pathlib import Path

from replica.engine.sim.cost import Fed, StepCost

PHASES = ("prefill", "decode")


class _Grid:
    """ms at (batch_size, context_len), bilinear inside the grid, linear past its edges."""

    def __init__(self, points: dict[tuple[int, int], float], phase: str) -> None:
        self.batches = sorted({b for b, _ in points})
        self.contexts = sorted({c for _, c in points})
        missing = [(b, c) for b in self.batches for c in self.contexts if (b, c) not in points]
        if missing:
            raise ValueError(f"profile table: {phase} rows do not form a full grid (missing {missing[:3]})")
        self.points = points

    def at(self, batch: float, context: float) -> float:
        b0, b1, tb = _bracket(self.batches, batch)
        c0, c1, tc = _bracket(self.contexts, context)
        p = self.points
        low = p[b0, c0] + (p[b0, c1] - p[b0, c0]) * tc
        high = p[b1, c0] + (p[b1, c1] - p[b1, c0]) * tc
        return max(low + (high - low) * tb, 0.0)


def _bracket(axis: list[int], x: float) -> tuple[int, int, float]:
    """Two neighbouring axis points around `x` (the last two past an edge) and x's position between."""
    if len(axis) == 1:
        return axis[0], axis[0], 0.0
    i = min(max(bisect.bisect_left(axis, x), 1), len(axis) - 1)
    lo, hi = axis[i - 1], axis[i]
    return lo, hi, (x - lo) / (hi - lo)


class ProfileCost:
    """A `CostModel` over a profile table (see module docstring)."""

    def __init__(self, grids: dict[str, _Grid], num_layers: int) -> None:
        self.grids = grids
        self.num_layers = num_layers

    @classmethod
    def load(cls, path: Path, num_layers: int) -> ProfileCost:
        """Read and check the table."""
        points: dict[str, dict[tuple[int, int], float]] = {phase: {} for phase in PHASES}
        with Path(path).open(newline="") as f:
            for line, row in enumerate(csv.DictReader(f), start=2):
                try:
                    phase = row["phase"].strip()
                    key = (int(row["batch_size"]), int(row["context_len"]))
                    ms = float(row["ms"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{path}:{line}: need phase,batch_size,context_len,ms ({exc})") from None
                if phase not in points or key[0] <= 0 or key[1] <= 0 or ms < 0:
                    raise ValueError(f"{path}:{line}: bad row {dict(row)}")
                points[phase][key] = ms
        empty = [phase for phase in PHASES if not points[phase]]
        if empty:
            raise ValueError(f"{path}: no {' or '.join(empty)} rows")
        return cls({phase: _Grid(points[phase], phase) for phase in PHASES}, num_layers)

    def step(self, seqs: Sequence[Fed]) -> StepCost:
        """Prefill part + decode part, spread over the layers."""
        prefill = [s for s in seqs if s.tokens > 1 or s.start == 0]
        decode = [s for s in seqs if not (s.tokens > 1 or s.start == 0)]
        ms = 0.0
        if prefill:
            mean = sum(s.tokens + s.start for s in prefill) / len(prefill)
            ms += self.grids["prefill"].at(len(prefill), mean)
        if decode:
            mean = sum(s.tokens + s.start for s in decode) / len(decode)
            ms += self.grids["decode"].at(len(decode), mean)
        return StepCost(0.0, ms / 1e3 / self.num_layers, 0.0, self.num_layers)
