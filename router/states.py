"""Router-side replica states and the one table of transitions between them (pure Python).

```
            load_prefill            loaded
 INACTIVE ─────────────► LOADING_PREFILL ─────► PREFILL ◄──────────── relay_end ── OLD_PREFILL
    │ ▲    load_decode                           │  │ ▲  relay_start ─────────────────▲
    │ │ ─────────────► LOADING_DECODE ─► DECODE  │  │ └─ revive ── DRAINING_PREFILL ◄─┘ drain
    │ │    live_load                               │  └─ mutate ─► MUTATING_TO_DECODE ─► DECODE
    │ └─ expire ── IDLE ◄── drained ── DRAINING_*  │
    └──────────► NEW_PREFILL ─ loaded ─► REFRACTORY_PREFILL ─ zigzag_done ─► PREFILL
 every live state ── died ──► DEAD ── answered ──► (the state it settles in)
```

Every state change of a replica goes through `move` (or `ReplicaStateMachine.move`): a change the
table does not list is a bug and raises `TransitionError`. The table is data, so it is printed by
`describe()`, unit-tested row by row, and shown to operators (ListReplicas, `/metrics`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class State(enum.Enum):
    """What a replica is doing, as the router sees it."""

    INACTIVE = "inactive"  # no weights
    LOADING_PREFILL = "loading_prefill"  # weights arriving; serves prefill once complete
    LOADING_DECODE = "loading_decode"  # weights arriving; serves decode once complete
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefills and decodes its own batches
    NEW_PREFILL = "new_prefill"  # serves prefill layer by layer while its weights arrive (zigzag)
    REFRACTORY_PREFILL = "refractory_prefill"  # weights complete, zigzag batches still in flight
    OLD_PREFILL = "old_prefill"  # a loaded prefill replica finishing batches relayed by a new one
    MUTATING_TO_DECODE = "mutating_to_decode"  # a prefill replica turning into a decode replica
    DRAINING_PREFILL = "draining_prefill"  # no new prefills; its batches leave by migration
    DRAINING_DECODE = "draining_decode"  # no new batches; decodes what it holds
    IDLE = "idle"  # drained, weights kept for a keep-alive period
    DEAD = "dead"  # unreachable or missed its heartbeats


class Trigger(enum.Enum):
    """Why a replica changes state."""

    LOAD_PREFILL = "load_prefill"  # the executor starts weights towards a new prefill replica
    LOAD_DECODE = "load_decode"  # ... towards a new decode replica
    LIVE_LOAD = "live_load"  # ... towards a new prefill replica that serves while loading
    LOADED = "loaded"  # every weight region arrived
    LOAD_FAILED = "load_failed"  # the transfer failed: rolled back to no weights
    ZIGZAG_DONE = "zigzag_done"  # the last layer-by-layer prefill of a new replica ended
    RELAY_START = "relay_start"  # a loaded prefill replica takes batches relayed by a new one
    RELAY_END = "relay_end"  # nothing left to relay
    MUTATE = "mutate"  # prefill down + decode up: keep the weights, change the job
    MUTATED = "mutated"  # its own batches now decode where they are
    DRAIN = "drain"  # scale-down or operator: no new work
    REVIVE = "revive"  # scale-up finds a draining replica of the needed kind
    DRAINED = "drained"  # holds nothing any more
    REACTIVATE = "reactivate"  # an idle replica with weights serves again
    EXPIRE = "expire"  # keep-alive over (or an operator): weights dropped (ResetStatus)
    ASSIGN = "assign"  # operator SetRole, start-up roles, strategy `colocated` on and off
    TAKE_PREFILL = "take_prefill"  # no prefill replica left: an empty decode replica takes the job
    DIED = "died"  # unreachable, or its heartbeats stopped
    ANSWERED = "answered"  # a dead replica answers again


S, T = State, Trigger


@dataclass(frozen=True)
class Transition:
    """One allowed change: `source` → `target` when `trigger` happens."""

    source: State
    target: State
    trigger: Trigger


_ROWS: tuple[tuple[State, Trigger, tuple[State, ...]], ...] = (
    (S.INACTIVE, T.LOAD_PREFILL, (S.LOADING_PREFILL,)),
    (S.INACTIVE, T.LOAD_DECODE, (S.LOADING_DECODE,)),
    (S.INACTIVE, T.LIVE_LOAD, (S.NEW_PREFILL,)),
    (S.LOADING_PREFILL, T.LOADED, (S.PREFILL, S.COLOCATED)),
    (S.LOADING_DECODE, T.LOADED, (S.DECODE,)),
    (S.LOADING_PREFILL, T.LOAD_FAILED, (S.INACTIVE,)),
    (S.LOADING_DECODE, T.LOAD_FAILED, (S.INACTIVE,)),
    (S.NEW_PREFILL, T.LOAD_FAILED, (S.INACTIVE,)),
    (S.NEW_PREFILL, T.LOADED, (S.REFRACTORY_PREFILL,)),
    (S.REFRACTORY_PREFILL, T.ZIGZAG_DONE, (S.PREFILL,)),
    (S.PREFILL, T.RELAY_START, (S.OLD_PREFILL,)),
    (S.OLD_PREFILL, T.RELAY_END, (S.PREFILL,)),
    (S.PREFILL, T.MUTATE, (S.MUTATING_TO_DECODE,)),
    (S.MUTATING_TO_DECODE, T.MUTATED, (S.DECODE,)),
    (S.PREFILL, T.DRAIN, (S.DRAINING_PREFILL,)),
    (S.OLD_PREFILL, T.DRAIN, (S.DRAINING_PREFILL,)),
    (S.DECODE, T.DRAIN, (S.DRAINING_DECODE,)),
    (S.COLOCATED, T.DRAIN, (S.DRAINING_DECODE,)),
    (S.DRAINING_PREFILL, T.REVIVE, (S.PREFILL,)),
    (S.DRAINING_DECODE, T.REVIVE, (S.DECODE, S.COLOCATED)),
    (S.DRAINING_PREFILL, T.DRAINED, (S.IDLE,)),
    (S.DRAINING_DECODE, T.DRAINED, (S.IDLE,)),
    (S.IDLE, T.REACTIVATE, (S.PREFILL, S.DECODE, S.COLOCATED)),
    (S.IDLE, T.EXPIRE, (S.INACTIVE,)),
    (S.PREFILL, T.ASSIGN, (S.DECODE, S.COLOCATED)),
    (S.DECODE, T.ASSIGN, (S.PREFILL, S.COLOCATED)),
    (S.COLOCATED, T.ASSIGN, (S.PREFILL, S.DECODE)),
    (S.DECODE, T.TAKE_PREFILL, (S.PREFILL,)),
    *((s, T.DIED, (S.DEAD,)) for s in State if s is not S.DEAD),
    (S.DEAD, T.ANSWERED, (S.INACTIVE, S.PREFILL, S.DECODE, S.COLOCATED, S.IDLE)),
)

TRANSITIONS: tuple[Transition, ...] = tuple(
    Transition(source, target, trigger) for source, trigger, targets in _ROWS for target in targets
)
_INDEX: Mapping[tuple[State, State], frozenset[Trigger]] = {
    (t.source, t.target): frozenset(u.trigger for u in TRANSITIONS
                                    if (u.source, u.target) == (t.source, t.target))
    for t in TRANSITIONS
}

# How the planner counts a state (`None`: neither kind).
PREFILL_LIKE = frozenset({S.PREFILL, S.LOADING_PREFILL, S.NEW_PREFILL, S.REFRACTORY_PREFILL, S.OLD_PREFILL})
DECODE_LIKE = frozenset({S.DECODE, S.LOADING_DECODE, S.MUTATING_TO_DECODE})
LOADING = frozenset({S.LOADING_PREFILL, S.LOADING_DECODE, S.NEW_PREFILL})
DRAINING = frozenset({S.DRAINING_PREFILL, S.DRAINING_DECODE})
# States whose loop takes new prompts from the queue.
TAKES_PREFILLS = frozenset({S.PREFILL, S.COLOCATED, S.NEW_PREFILL, S.REFRACTORY_PREFILL, S.OLD_PREFILL})
# States a migration may deliver a batch into.
TAKES_MIGRATIONS = frozenset({S.DECODE})
# States with complete weights that serve requests.
SERVING = frozenset({S.PREFILL, S.DECODE, S.COLOCATED, S.REFRACTORY_PREFILL, S.OLD_PREFILL})
# States that hold complete weights (a source for a weight transfer).
HOLDS_WEIGHTS = SERVING | {S.MUTATING_TO_DECODE, S.DRAINING_PREFILL, S.DRAINING_DECODE, S.IDLE}


class TransitionError(ValueError):
    """A state change the table does not allow (a bug of the caller, or a refused operator call)."""


def triggers(source: State, target: State) -> frozenset[Trigger]:
    """The triggers that may move `source` to `target` (empty: not allowed)."""
    return _INDEX.get((source, target), frozenset())


def check(source: State, target: State, trigger: Trigger) -> None:
    """Raise `TransitionError` unless the table allows `source` → `target` on `trigger`."""
    if trigger not in triggers(source, target):
        allowed = sorted(t.value for t in triggers(source, target))
        hint = f" (allowed on: {', '.join(allowed)})" if allowed else ""
        raise TransitionError(
            f"replica cannot go from {source.value} to {target.value} on {trigger.value}{hint}")


def targets(source: State, trigger: Trigger) -> tuple[State, ...]:
    """Where `trigger` may take a replica in `source` (empty: the trigger does not apply)."""
    return tuple(t.target for t in TRANSITIONS if t.source is source and t.trigger is trigger)


def describe(rows: Iterable[Transition] = TRANSITIONS) -> str:
    """The table as text, one transition a line (for docs and `--help`-style listings)."""
    return "\n".join(f"{t.source.value:>20} --{t.trigger.value}--> {t.target.value}" for t in rows)
