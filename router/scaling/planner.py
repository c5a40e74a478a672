"""The scaling planner: a pure function from a snapshot of the cluster to a plan.

```
 Snapshot (replica states and pages, queue, measured speeds) ──plan()──► Plan
     prefill: how many replicas the backlog needs   ── up / stay / down by n
     decode:  how many the KV pages and the migration stream need
     expire:  idle replicas whose keep-alive is over
```
Each kind has a *band* [needed at the upper bound, needed at the lower bound]: below it the kind
scales up (to the band's middle), above it the kind scales down by one replica per round, inside it
nothing happens — a load that sits between the bounds never causes an action, so the planner does
not oscillate. Replicas already loading count as the kind they will be, so a scale-up in flight is
not asked for twice. The counts always stay in [min, max] of each kind. A kind never scales down
while one of its replicas is still loading or changing, within `cooldown` seconds of its last
scale-up (a burst that dips between two rounds does not undo the scale-up it caused), or below
`min` replicas that serve now.

Load measures (as in the reference system, with its bug of using the migration upper bound twice
fixed):
- prefill load: seconds of queued prompt work per prefill replica,
  `waiting prefill tokens / (n_prefill · prefill tokens/s)`, kept within [prefill_lower, prefill_upper];
  and enough replicas to keep up with the prompts arriving (`arriving tokens/s / prefill tokens/s`,
  at most `prefill_busy_upper` of each replica's time, at least `prefill_busy_lower` to keep one): a
  steady load whose queue empties between batches does not look idle; the arrivals over the short
  surge window count beyond the replicas' whole capacity while prompts wait (a step in load shows
  there first; a Poisson clump of a quiet load that the replicas absorb does not); with a TTFT
  SLO, no more than `ttft_slo` seconds of queued prompt work per replica;
- decode load: the fraction of KV pages in use over the decode replicas, within
  [decode_lower, decode_upper]; with a TPOT SLO (`tpot_slo`) instead the measured TPOT, the decode
  batch and the migration backlog, pages bounding it from above only, and a scale-down only after
  the load allowed it for `cooldown` seconds (`decode_band`);
- migration load: seconds of KV waiting to be migrated per decode replica,
  `migrating tokens / (n_decode · migration tokens/s)`, at most migration_upper.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.states import DECODE_LIKE, PREFILL_LIKE, State
from router.types import ReplicaId

# Replicas of each kind that serve now (the others of the kind are loading or changing).
PREFILL_SERVES = frozenset({State.PREFILL, State.OLD_PREFILL, State.REFRACTORY_PREFILL})
DECODE_SERVES = frozenset({State.DECODE})


class Direction(enum.Enum):
    """What a plan says of one kind of replica."""

    UP = "up"
    STAY = "stay"
    DOWN = "down"


@dataclass(frozen=True)
class ReplicaSample:
    """One replica in a snapshot."""

    id: ReplicaId
    state: State
    used_pages: int
    total_pages: int
    transfers: int = 0  # weight transfers or other scaling actions in flight on it
    idle_since: float | None = None  # when it became IDLE (keep-alive clock)
    batch: int = 0  # requests it holds (decode: its running batch and what is arriving)
    tpot: float = 0.0  # its measured seconds per decode step (running average; 0 = not measured)
    tp: int = 1  # ranks of its tensor-parallel group (it counts as one replica whatever its size)


@dataclass(frozen=True)
class Snapshot:
    """What the planner sees at one instant."""

    now: float
    replicas: tuple[ReplicaSample, ...]
    waiting_prefill_tokens: int = 0
    waiting_requests: int = 0
    migrating_tokens: int = 0  # prefilled tokens whose KV still waits for (or is on) a migration
    arriving_tokens_per_s: float = 0.0  # prompt tokens submitted per second (running average)
    surge_tokens_per_s: float = 0.0  # the same over the short surge window (a step in load shows here first)
    prefill_tokens_per_s: float = 0.0  # one prefill replica's measured rate (running average)
    migration_tokens_per_s: float = 0.0  # one decode replica's measured intake (running average)
    prefill_up_at: float | None = None  # when the prefill kind last scaled up
    decode_up_at: float | None = None  # when the decode kind last scaled up
    decode_calm_since: float | None = None  # since when every round allowed one decode replica fewer

    def count(self, kind: frozenset[State]) -> int:
        """Replicas in any of these states."""
        return sum(1 for r in self.replicas if r.state in kind)


@dataclass(frozen=True)
class Bounds:
    """The planner's configuration (validated on construction)."""

    prefill_lower: float = 0.15
    prefill_upper: float = 0.4
    decode_lower: float = 0.45
    decode_upper: float = 0.8
    migration_upper: float = 2.0
    prefill_busy_lower: float = 0.3
    prefill_busy_upper: float = 0.9
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    keep_alive: float = 10.0
    cooldown: float = 5.0
    ttft_slo: float = 0.0  # seconds; > 0: no more queued prompt work per prefill replica than this
    tpot_slo: float = 0.0  # seconds; > 0: decode is planned on TPOT, batch and migration (decode_band)
    tpot_lower: float = 0.5  # scale decode down only when the smaller cluster's TPOT is under this x SLO
    decode_batch_limit: int = 256  # requests one decode replica may run (the batch term's limit)

    def __post_init__(self) -> None:
        pairs = (("prefill", self.prefill_lower, self.prefill_upper),
                 ("decode", self.decode_lower, self.decode_upper),
                 ("prefill busy", self.prefill_busy_lower, self.prefill_busy_upper))
        for name, lower, upper in pairs:
            if not 0 <= lower < upper:
                raise ValueError(f"{name} load bounds need 0 <= lower < upper (got {lower}, {upper})")
        if self.decode_upper > 1 or self.prefill_busy_upper > 1:
            raise ValueError("decode_upper and prefill_busy_upper are fractions, at most 1 (got "
                             f"{self.decode_upper}, {self.prefill_busy_upper})")
        if self.migration_upper <= 0:
            raise ValueError(f"migration_upper must be > 0 (got {self.migration_upper})")
        for name, low, high in (("prefill", self.min_prefill, self.max_prefill),
                                ("decode", self.min_decode, self.max_decode)):
            if not 0 <= low <= high:
                raise ValueError(f"replica counts need 0 <= min_{name} <= max_{name} (got {low}, {high})")
        if self.ttft_slo < 0 or self.tpot_slo < 0:
            raise ValueError(f"ttft_slo and tpot_slo must be >= 0 (0 = none), got {self.ttft_slo}, "
                             f"{self.tpot_slo}")
        if not 0 < self.tpot_lower < 1 or self.decode_batch_limit < 1:
            raise ValueError(f"tpot_lower must be in (0, 1) and decode_batch_limit >= 1 (got "
                             f"{self.tpot_lower}, {self.decode_batch_limit})")
        if self.keep_alive < 0 or self.cooldown < 0:
            raise ValueError(f"keep_alive and cooldown must be >= 0 (got {self.keep_alive}, {self.cooldown})")


@dataclass(frozen=True)
class KindPlan:
    """The decision for one kind: current count, the band it must be in, and the move."""

    current: int
    low: int  # fewest replicas the load allows (needed at the upper bound)
    high: int  # most replicas the load justifies (needed at the lower bound)
    delta: int

    @property
    def direction(self) -> Direction:
        """Up, stay or down."""
        return Direction.UP if self.delta > 0 else Direction.DOWN if self.delta < 0 else Direction.STAY


@dataclass(frozen=True)
class Plan:
    """One round's decision (and the loads it came from, for the timeline)."""

    prefill: KindPlan
    decode: KindPlan
    expire: tuple[ReplicaId, ...] = ()
    loads: dict[str, float] = field(default_factory=dict)
    decode_calm: bool = False  # the decode load allowed one replica fewer (the calm clock runs on)

    @property
    def idle(self) -> bool:
        """Nothing to do this round."""
        return self.prefill.delta == 0 and self.decode.delta == 0 and not self.expire


def plan(snapshot: Snapshot, bounds: Bounds) -> Plan:
    """Decide how many prefill and decode replicas to add or remove (see the module docstring)."""
    n_prefill, n_decode = snapshot.count(PREFILL_LIKE), snapshot.count(DECODE_LIKE)
    p_low, p_high = _prefill_band(snapshot, bounds)
    slo = bounds.tpot_slo > 0
    d_low, d_high = decode_band(snapshot, bounds) if slo else _decode_band(snapshot, bounds)
    prefill = _decide(n_prefill, p_low, p_high, bounds.min_prefill, bounds.max_prefill)
    decode = _decide(n_decode, d_low, d_high, bounds.min_decode, bounds.max_decode)
    calm = decode.delta < 0
    if slo and calm and not calmed(snapshot, bounds):  # hysteresis in time as well as in load
        decode = dataclasses.replace(decode, delta=0)
    prefill = _hold(prefill, snapshot, PREFILL_LIKE, PREFILL_SERVES, snapshot.prefill_up_at,
                    bounds.min_prefill, bounds.cooldown)
    decode = _hold(decode, snapshot, DECODE_LIKE, DECODE_SERVES, snapshot.decode_up_at,
                   bounds.min_decode, bounds.cooldown)
    loads = {**_loads(snapshot), **(decode_loads(snapshot) if slo else {})}
    return Plan(prefill, decode, _expired(snapshot, bounds, prefill, decode), loads, calm)


def _hold(decided: KindPlan, s: Snapshot, kind: frozenset[State], serves: frozenset[State],
          up_at: float | None, minimum: int, cooldown: float) -> KindPlan:
    """No scale-down while the kind is changing, just after it scaled up, or at its serving minimum."""
    if decided.delta >= 0:
        return decided
    changing = s.count(kind - serves) > 0
    recent = up_at is not None and s.now - up_at < cooldown
    if changing or recent or s.count(serves) <= minimum:
        return dataclasses.replace(decided, delta=0)
    return decided


def _prefill_band(s: Snapshot, b: Bounds) -> tuple[int, int]:
    if s.prefill_tokens_per_s <= 0:  # nothing measured yet: keep what there is
        current = s.count(PREFILL_LIKE)
        return current, current
    work = s.waiting_prefill_tokens / s.prefill_tokens_per_s  # seconds of prompt work in the queue
    busy = s.arriving_tokens_per_s / s.prefill_tokens_per_s  # replicas' worth of arriving work
    # the same over the short window, while prompts wait (else the replicas are keeping up)
    surge = s.surge_tokens_per_s / s.prefill_tokens_per_s if s.waiting_prefill_tokens else 0.0
    # the short window is noisier: it counts only beyond the replicas' whole capacity (a queue grows)
    low = max(math.ceil(work / b.prefill_upper), math.ceil(busy / b.prefill_busy_upper), math.ceil(surge))
    if b.ttft_slo > 0:  # a prompt queued behind `work / n` seconds of prompts misses the SLO
        low = max(low, math.ceil(work / b.ttft_slo))
    high = max(math.ceil(work / b.prefill_lower), math.ceil(busy / b.prefill_busy_lower))
    return low, high


def _decode_band(s: Snapshot, b: Bounds) -> tuple[int, int]:
    decode = [r for r in s.replicas if r.state in DECODE_LIKE]
    pages = max((r.total_pages for r in decode), default=0) or max(
        (r.total_pages for r in s.replicas), default=0)
    used = sum(r.used_pages for r in decode)
    if pages <= 0:
        return 0, 0
    low, high = math.ceil(used / b.decode_upper / pages), math.ceil(used / b.decode_lower / pages)
    if s.migration_tokens_per_s > 0:  # enough decode replicas to take the KV stream in time
        low = max(low, math.ceil(s.migrating_tokens / b.migration_upper / s.migration_tokens_per_s))
        high = max(high, low)
    return low, high


def decode_band(s: Snapshot, b: Bounds) -> tuple[int, int]:
    """The decode band under a TPOT SLO. Low (must have): TPOT within the SLO (`n · TPOT / SLO`,
    TPOT the batch-weighted mean over the decode replicas running a batch), the decode batch within
    `decode_batch_limit` per replica, the migration backlog within `migration_upper`, KV pages within
    `decode_upper`. High (may keep): the same with TPOT under `tpot_lower` of the SLO, the batch under
    half its limit, the migration backlog under half its bound; page use no longer says
    "scale down" (a GPU's pool is mostly empty), it only bounds the count from above."""
    serving = [r for r in s.replicas if r.state in DECODE_LIKE]
    pages = max((r.total_pages for r in serving), default=0) or max((r.total_pages for r in s.replicas),
                                                                     default=0)
    used = sum(r.used_pages for r in serving)
    need_pages = math.ceil(used / b.decode_upper / pages) if pages > 0 else 0
    tpot, busy = _tpot(serving), sum(1 for r in serving if r.batch > 0)
    batch = sum(r.batch for r in serving)
    migration = s.migrating_tokens / s.migration_tokens_per_s if s.migration_tokens_per_s > 0 else 0.0
    low = max(need_pages, math.ceil(busy * tpot / b.tpot_slo), math.ceil(batch / b.decode_batch_limit),
              math.ceil(migration / b.migration_upper))
    high = max(low, math.ceil(busy * tpot / (b.tpot_slo * b.tpot_lower)),
               math.ceil(2 * batch / b.decode_batch_limit), math.ceil(2 * migration / b.migration_upper))
    return low, high


def _tpot(replicas: Sequence[ReplicaSample]) -> float:
    """Batch-weighted mean measured TPOT of the replicas running a batch (0 when none does)."""
    running = [r for r in replicas if r.batch > 0 and r.tpot > 0]
    weight = sum(r.batch for r in running)
    return sum(r.tpot * r.batch for r in running) / weight if weight else 0.0


def calmed(s: Snapshot, b: Bounds) -> bool:
    """Decode may shrink: every round for `cooldown` seconds allowed one replica fewer."""
    return s.decode_calm_since is not None and s.now - s.decode_calm_since >= b.cooldown


def decode_loads(s: Snapshot) -> dict[str, float]:
    """The decode measures behind an SLO decision (written to the timeline)."""
    serving = [r for r in s.replicas if r.state in DECODE_LIKE]
    return {"decode_tpot_s": _tpot(serving), "decode_batch": float(sum(r.batch for r in serving))}


def _decide(current: int, low: int, high: int, minimum: int, maximum: int) -> KindPlan:
    low = min(max(low, minimum), maximum)
    high = min(max(high, low), maximum)
    if current < low:
        delta = (low + high + 1) // 2 - current  # aim at the band's middle, not its edge
    elif current > high:
        delta = -1  # one replica per round: the load may come back before the next round
    else:
        delta = 0
    return KindPlan(current, low, high, delta)


def _expired(s: Snapshot, b: Bounds, prefill: KindPlan, decode: KindPlan) -> tuple[ReplicaId, ...]:
    """Idle replicas past their keep-alive, unless this round scales up (they are reused first)."""
    if prefill.delta > 0 or decode.delta > 0:
        return ()
    idle = sorted((r for r in s.replicas if r.state is State.IDLE and r.idle_since is not None
                   and r.transfers == 0), key=lambda r: (r.idle_since, r.id))
    return tuple(r.id for r in idle if s.now - (r.idle_since or 0.0) >= b.keep_alive)[:1]


def _loads(s: Snapshot) -> dict[str, float]:
    """The measured loads behind the decision (written to the timeline)."""
    n_prefill, n_decode = s.count(PREFILL_LIKE), s.count(DECODE_LIKE)
    decode_pages = sum(r.total_pages for r in s.replicas if r.state in DECODE_LIKE)
    used = sum(r.used_pages for r in s.replicas if r.state in DECODE_LIKE)
    return {
        "prefill_backlog_s": _ratio(s.waiting_prefill_tokens, n_prefill * s.prefill_tokens_per_s),
        "prefill_busy": _ratio(s.arriving_tokens_per_s, n_prefill * s.prefill_tokens_per_s),
        "prefill_surge": _ratio(s.surge_tokens_per_s, n_prefill * s.prefill_tokens_per_s),
        "decode_pages_used": _ratio(used, decode_pages),
        "migration_backlog_s": _ratio(s.migrating_tokens, n_decode * s.migration_tokens_per_s),
        "waiting_requests": float(s.waiting_requests),
        "waiting_prefill_tokens": float(s.waiting_prefill_tokens),
    }


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def samples_in(snapshot: Snapshot, states: Sequence[State]) -> list[ReplicaSample]:
    """The snapshot's replicas in these states, in id order."""
    return sorted((r for r in snapshot.replicas if r.state in states), key=lambda r: r.id)
