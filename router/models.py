"""Several models in one router: what each model is, and the pure rules that share replicas among them.

```
 --models NAME=DIR[,min-prefill=N,...]  ──parse_model──► ModelSpec (name, checkpoint, bound overrides)
 per model: its plan's scale-up, its inactive replicas, a request waiting at zero
     ──rebalance(needs, spare)──► which inactive replicas go back to the shared pool, how many each
                                  model borrows from it
 a wake with no spare ──reclaim_order──► another model's idle replica (keep-alive), then a quiet model's
                                       serving replica (nothing queued or held), to give up its weights
 a model at zero with a request waiting ──wake_action──► Reactivate an idle replica | p2p from a holder
                                                        | LoadParams from the target's own host copy
                                                        | a peer's host copy over the network
                                                        | LoadParams (host cache, else disk)
```
Pure: no asyncio, no replica calls (`router/pools.py` runs them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from router.scaling.actions import Action, Capabilities, Kind, Load, Reactivate
from router.scaling.planner import Bounds, ReplicaSample
from router.states import HOLDS_WEIGHTS, State
from router.types import ReplicaId
from router.weights import TRANSFER_METHODS, Method

# per-model bound overrides a `--models` entry may carry (flag spelling → Bounds field, its type)
_OVERRIDES: dict[str, tuple[str, type]] = {
    "min-prefill": ("min_prefill", int), "max-prefill": ("max_prefill", int),
    "min-decode": ("min_decode", int), "max-decode": ("max_decode", int),
    "keep-alive": ("keep_alive", float),
}


@dataclass(frozen=True)
class ModelSpec:
    """One served model: the name clients use, its checkpoint, and planner bounds of its own."""

    name: str
    path: Path
    overrides: Mapping[str, float] = field(default_factory=dict)  # Bounds field → value

    def bounds(self, base: Bounds) -> Bounds:
        """`base` with this model's overrides (ValueError when they contradict it)."""
        return dataclasses.replace(base, **self.overrides)  # type: ignore[arg-type]


def parse_model(text: str) -> ModelSpec:
    """`NAME=DIR[,min-prefill=N][,min-decode=N][,max-prefill=N][,max-decode=N][,keep-alive=S]`
    (ValueError naming what is wrong)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--models takes NAME=DIR[,key=value...], got {text!r}")
    path, *options = rest.split(",")
    overrides: dict[str, float] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if key not in _OVERRIDES or not eq:
            raise ValueError(f"--models {name}: unknown option {option!r}; options: {', '.join(_OVERRIDES)}")
        attr, kind = _OVERRIDES[key]
        try:
            overrides[attr] = kind(value)
        except ValueError:
            raise ValueError(f"--models {name}: {key} must be a number, got {value!r}") from None
    return ModelSpec(name, Path(path), overrides)


@dataclass(frozen=True)
class PoolNeed:
    """One model's pool as the sharing rule sees it."""

    want: int  # replicas its plan asks to add (both kinds' scale-up)
    inactive: tuple[ReplicaId, ...] = ()  # its inactive replicas that no action holds
    waking: bool = False  # a request waits for its first serving replica


@dataclass(frozen=True)
class Rebalance:
    """What a sharing round does."""

    release: Mapping[str, tuple[ReplicaId, ...]]  # inactive replicas each model gives back
    lend: Mapping[str, int]  # spare replicas each model borrows


def rebalance(needs: Mapping[str, PoolNeed], spare: int) -> Rebalance:
    """A model that wants no replica gives its inactive ones back; models short of inactive replicas
    borrow from the spare ones (those just given back included) — a model waking from zero first,
    then the largest shortfall, then by name (deterministic)."""
    release = {m: n.inactive for m, n in needs.items() if n.inactive and n.want == 0 and not n.waking}
    pool = spare + sum(len(r) for r in release.values())
    short = {m: max(n.want, 1 if n.waking else 0) - len(n.inactive) for m, n in needs.items()}
    order = sorted((m for m, k in short.items() if k > 0), key=lambda m: (not needs[m].waking, -short[m], m))
    lend: dict[str, int] = {}
    for model in order:
        given = min(short[model], pool)
        if given:
            lend[model] = given
            pool -= given
    return Rebalance(release, lend)


HOST_SOURCES = 2  # peers a model at zero reads its host copy from at once, a share of the regions each


@dataclass(frozen=True)
class HostCopies:
    """The host-memory copies of one replica outside the waking model's pool (another model's
    replica, or a spare): what it could send over the network (Info `host_copies`)."""

    address: str
    models: frozenset[str]


def wake_action(replicas: Sequence[ReplicaSample], caps: Capabilities, model: str = "",
                own: Mapping[ReplicaId, frozenset[str]] | None = None,
                peers: Sequence[HostCopies] = ()) -> Action | None:
    """How `model`, with no serving replica, gets one, in order of preference: an idle replica that
    kept its weights serves again; else weights go into an inactive replica p2p from a replica of
    the pool that holds them (a policy with a transfer method); else LoadParams from a target's own
    host copy (`own`: each inactive replica's host copies); else, under a policy with
    `Method.HOST_PEER`, peers' host copies sent over the network (`peers`: every other replica of the
    cluster, BlitzScale's cluster-wide pool; up to HOST_SOURCES of them at once, a share each);
    else LoadParams from the node's host cache, from disk on a miss (as ServerlessLLM does), or
    from disk alone under a policy that only loads from disk.
    A host copy's name can be trusted under every policy: every transfer names its model and the
    receiver records it. None: no inactive replica."""
    free = [r for r in replicas if r.transfers == 0]
    idle = sorted(r.id for r in free if r.state is State.IDLE)
    if idle:
        return Reactivate(idle[0], Kind.PREFILL)
    targets = sorted(r.id for r in free if r.state is State.INACTIVE)
    if not targets:
        return None
    holders = sorted(r.id for r in free if r.state in HOLDS_WEIGHTS)
    if holders and any(m in TRANSFER_METHODS for m in caps.methods):
        return Load(Method.P2P, (holders[0],), (targets[0],), Kind.PREFILL)
    if caps.methods == (Method.LOAD_DISK,):
        return Load(Method.LOAD_DISK, (), (targets[0],), Kind.PREFILL)
    holding = [t for t in targets if model and model in (own or {}).get(t, frozenset())]
    if holding:
        return Load(Method.LOAD_HOST, (), (holding[0],), Kind.PREFILL)
    senders = sorted(p.address for p in peers if model and model in p.models)
    if senders and Method.HOST_PEER in caps.methods:  # a share from each of the first HOST_SOURCES
        return Load(Method.HOST_PEER, (), (targets[0],), Kind.PREFILL,
                    peers=tuple(senders[:HOST_SOURCES]))
    return Load(Method.LOAD_HOST, (), (targets[0],), Kind.PREFILL)


@dataclass(frozen=True)
class Held:
    """A replica of another model's pool, as the reclaim rule sees it."""

    model: str
    replica: ReplicaId
    state: State
    since: float  # when it entered its state
    quiet: bool  # its model has nothing queued, held, waiting for a wake, or any action in flight
    arrivals: float  # its model's recent arrival rate (prompt tokens/s)


RECLAIMABLE = frozenset({State.PREFILL, State.DECODE, State.COLOCATED})  # drained first, then reset


def reclaim_order(held: Sequence[Held]) -> list[Held]:
    """Which replicas a wake with no spare may take, in order: idle ones (kept only for a keep-alive)
    idle longest first; then serving replicas of quiet models, the least requested model first (a
    serverless system's idle instance: nothing in flight), the longest in its state first."""
    idle = sorted((h for h in held if h.state is State.IDLE), key=lambda h: (h.since, h.replica))
    quiet = sorted((h for h in held if h.quiet and h.state in RECLAIMABLE),
                   key=lambda h: (h.arrivals, h.since, h.replica))
    return [*idle, *quiet]
