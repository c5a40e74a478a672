"""What a serving run sends and when: synthetic arrivals or a replayed trace, fitted to the model (pure).

```
 synthetic: poisson_arrivals / gamma_arrivals (rate, CV) × lengths (fixed, uniform, or pairs of a trace)
 phased:    Poisson at each phase's rate for its seconds (a quiet phase, a burst, quiet again) × lengths
 trace:     read_trace (traces.py) ─► replay(window, speed | target rate, num) ─► [Arrival]
                                              └──────────► clip(max input, max total) ─► client
```
Arrival times are seconds from the run's start. Gamma inter-arrival gaps with coefficient of
variation CV have shape 1/CV² and mean 1/rate: CV 1 is Poisson, CV > 1 burstier, CV < 1 smoother.
Everything random draws from `random.Random(seed)`: one seed, one workload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdcluster.bench.serving.traces import TraceRow, read_trace


@dataclass(frozen=True)
class Arrival:
    """One request of the workload: when to send it (seconds from start), its lengths, its prefix blocks."""

    at: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    model: str = ""  # which of a router's models it asks for ("": the default one)


@dataclass(frozen=True)
class Lengths:
    """How long prompts or outputs are: `low` when fixed (`high` == `low`), else uniform in [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths need 1 <= low <= high, got {self.low}..{self.high}")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        """Always `n` tokens."""
        return cls(n, n)

    def draw(self, rng: random.Random) -> int:
        """One length."""
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


def gaps(num: int, rate: float, cv: float, rng: random.Random) -> list[float]:
    """`num` inter-arrival gaps of mean 1/rate and coefficient of variation `cv` (0 when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * num
    if cv <= 0:
        return [1.0 / rate] * num  # CV 0: evenly spaced
    shape = 1.0 / (cv * cv)
    return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(num)]


def synthetic(
    num: int, rate: float, cv: float, inputs: Lengths, outputs: Lengths, seed: int = 0,
    pairs: Sequence[TraceRow] = (),
) -> list[Arrival]:
    """`num` requests at `rate`/s with gamma gaps of CV `cv`, the first at t=0; lengths drawn from
    `inputs` / `outputs`, or, given `pairs`, (input, output) pairs drawn from a trace's rows."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for gap in gaps(num, rate, cv, rng):
        if pairs:
            row = pairs[rng.randrange(len(pairs))]
            arrivals.append(Arrival(at, max(1, row.input_len), max(1, row.output_len)))
        else:
            arrivals.append(Arrival(at, inputs.draw(rng), outputs.draw(rng)))
        at += gap
    return arrivals


@dataclass(frozen=True)
class Phase:
    """A stretch of the load: `seconds` long, Poisson arrivals at `rate` requests/s (0: none)."""

    seconds: float
    rate: float

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"a phase lasts a finite positive number of seconds, got {self.seconds}")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise ValueError(f"a phase's rate is a finite number >= 0 of requests/s, got {self.rate}")


def phase_starts(phases: Sequence[Phase]) -> list[float]:
    """When each phase begins (seconds from the load's start)."""
    starts, at = [], 0.0
    for phase in phases:
        starts.append(at)
        at += phase.seconds
    return starts


def phased(
    phases: Sequence[Phase], inputs: Lengths, outputs: Lengths, seed: int = 0, num: int = 0,
    pairs: Sequence[TraceRow] = (),
) -> list[Arrival]:
    """A Poisson process whose rate steps from phase to phase: within each phase, exponential gaps of
    mean 1/rate from the phase's start, and none past its end (the process is memoryless, so cutting
    at the boundary and starting afresh is exact). The first `num` requests (0: all); lengths as in
    `synthetic`."""
    if not any(p.rate > 0 for p in phases):
        raise ValueError("phased arrivals need a phase with a rate > 0")
    rng = random.Random(seed)
    arrivals = []
    for phase, start in zip(phases, phase_starts(phases), strict=True):
        at = start + (rng.expovariate(phase.rate) if phase.rate > 0 else phase.seconds)
        while at < start + phase.seconds:
            if pairs:
                row = pairs[rng.randrange(len(pairs))]
                arrivals.append(Arrival(at, max(1, row.input_len), max(1, row.output_len)))
            else:
                arrivals.append(Arrival(at, inputs.draw(rng), outputs.draw(rng)))
            at += rng.expovariate(phase.rate)
    return arrivals[:num] if num else arrivals


def poisson_arrivals(num: int, rate: float, input_len: int, output_len: int, seed: int = 0) -> list[Arrival]:
    """`num` requests with exponential gaps of mean 1/rate (all at t=0 when rate is inf)."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for _ in range(num):
        arrivals.append(Arrival(at, input_len, output_len))
        if math.isfinite(rate):
            at += rng.expovariate(rate)
    return arrivals


def conversation_arrivals(num: int, rate: float, turns: int, turn_len: int, output_len: int,
                          seed: int = 0) -> list[Arrival]:
    """`num` requests of a multi-turn chat load, Poisson-timed as `poisson_arrivals`: conversations
    of `turns` turns, request k is turn k // C of conversation k % C (C conversations: every first
    turn, then every second, ...). Turn t's prompt is its conversation's blocks 0..t of `turn_len`
    tokens each (`hash_ids`, for a `PromptMaker` with `block_tokens=turn_len`): each turn repeats
    the conversation so far and adds `turn_len` tokens."""
    if turns < 1 or turn_len < 1:
        raise ValueError("turns and turn_len must be >= 1")
    convs = -(-num // turns)
    timed = poisson_arrivals(num, rate, turn_len, output_len, seed)
    out = []
    for k, arrival in enumerate(timed):
        conv, turn = k % convs, k // convs
        blocks = tuple(conv * turns + i for i in range(turn + 1))
        out.append(Arrival(arrival.at, turn_len * (turn + 1), output_len, blocks))
    return out


def replay(
    rows: Sequence[TraceRow], num: int = 0, window: tuple[float, float] | None = None,
    speed: float = 1.0, rate: float = 0.0,
) -> list[Arrival]:
    """The trace's requests inside `window` (seconds of trace time, [start, end)), the first `num` of
    them (0: all), shifted to start at 0 and time-scaled: by `speed` (2 = twice as fast), or, when
    `rate` > 0, so that their mean arrival rate is `rate` requests/s (request-rate scaling)."""
    if window is not None:
        start, end = window
        rows = [r for r in rows if start <= r.at < end]
    if num:
        rows = rows[:num]
    if not rows:
        raise ValueError("no trace requests in the chosen window")
    first, span = rows[0].at, rows[-1].at - rows[0].at
    if rate > 0:
        # n requests over `span` seconds arrive at (n - 1) / span per second; scale that to `rate`
        speed = rate * span / (len(rows) - 1) if span > 0 and len(rows) > 1 else 1.0
    if not speed > 0:
        raise ValueError(f"trace speed must be > 0, got {speed}")
    return [Arrival((r.at - first) / speed, r.input_len, r.output_len, r.hash_ids) for r in rows]


def load_trace(path: Path, num: int, speed: float = 1.0) -> list[Arrival]:
    """The first `num` requests of a trace file (any format of `traces.py`); times divided by `speed`."""
    return replay(read_trace(path), num=num, speed=speed)


def clip(arrivals: Sequence[Arrival], max_input: int, max_total: int, max_output: int = 0) -> list[Arrival]:
    """Fit each request into the model's limits: input ≤ max_input, input + output ≤ max_total, output ≤
    max_output (when > 0), both ≥ 1. Prefix blocks beyond the kept prompt are dropped."""
    fitted = []
    for a in arrivals:
        input_len = max(1, min(a.input_len, max_input, max_total - 1))
        output_len = max(1, min(a.output_len, max_total - input_len, max_output or a.output_len))
        fitted.append(Arrival(a.at, input_len, output_len, a.hash_ids))
    return fitted


def offered_rate(arrivals: Sequence[Arrival]) -> float:
    """Mean requests/s of the workload: (n - 1) / span of arrivals (inf when they all come at once)."""
    if len(arrivals) < 2:
        return math.inf
    span = arrivals[-1].at - arrivals[0].at
    return (len(arrivals) - 1) / span if span > 0 else math.inf
