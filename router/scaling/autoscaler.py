"""The autoscaler: every `plan_interval` a snapshot, the planner, the executor — while serving.

```
 every plan_interval (policy that plans):
   snapshot (states, pages, busy replicas, queue, rates) ─► planner.plan ─► actions.choose
   ─► one task per action (Executor.run) ─► timeline: the round, its loads, its actions
```
Between rounds, `poke` (every arrival) plans at once when `triggers.urgency` says the prefill replicas
are too few for what is queued or arriving; the round's record names its reason. Rounds never
overlap (each runs synchronously on the event loop), and an action's replicas are left alone until
it ends. `set_policy` switches
the policy at run time (actions in flight finish; `static` stops planning).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import asdict

from router.registry import ReplicaHandle
from router.replicas import State
from router.scaling import policies
from router.scaling.actions import Action, Kind, Load, choose
from router.scaling.executor import Executor, ScalingHost, action_name
from router.scaling.planner import Bounds, Plan, ReplicaSample, Snapshot, plan
from router.scaling.policies import Policy
from router.scaling.rates import Rates
from router.scaling.timeline import Timeline
from router.scaling.triggers import urgency
from router.states import HOLDS_WEIGHTS, PREFILL_LIKE
from router.types import ReplicaId
from router.weights import Method

log = logging.getLogger("pdcluster.router")
URGENT_GAP_S = 0.05  # urgent rounds at most this often (each arrival of a burst would plan again)
_KINDS = {State.PREFILL: Kind.PREFILL, State.DECODE: Kind.DECODE}  # roles a restarted replica gets back


class Autoscaler:
    """Plans and scales the cluster by itself under a scaling policy."""

    def __init__(self, host: ScalingHost, policy: str, bounds: Bounds, interval: float, rates: Rates,
                 timeline: Timeline, on_action: Callable[[str, bool], None] | None = None) -> None:
        self.host = host
        self.policy: Policy = policies.get(policy)
        self.bounds = bounds
        self.interval = interval
        self.rates = rates
        self.timeline = timeline
        self.executor = Executor(host, timeline, on_action or (lambda _name, _ok: None))
        self.tasks: set[asyncio.Task[bool]] = set()
        self.rounds = 0
        self.up_at: dict[Kind, float] = {}  # when each kind last scaled up (the planner's cooldown)
        self.urgent_rounds = 0
        self.calm_since: float | None = None  # since when decode rounds allowed one replica fewer
        self._last_urgent = -math.inf
        # an urgent round that wants prefill but finds no replica to load: its pool may get one now
        # (several models: `router/pools.py` lends a shared spare at once and plans again)
        self.on_short: Callable[[str], None] | None = None
        # requests waiting outside the queue for this model's wake (several models): while any does,
        # a round keeps at least one prefill replica (its first serving one is not drained under it)
        self.awaited: Callable[[], int] | None = None
        self._task: asyncio.Task[None] | None = None

    def set_policy(self, name: str) -> str:
        """Switch the policy (ValueError for an unknown name); returns the previous one's name."""
        previous, self.policy = self.policy, policies.get(name)
        log.info("scaling policy: %s -> %s", previous.name, self.policy.name)
        self.timeline.write("policy", previous=previous.name, policy=self.policy.name)
        return previous.name

    def start(self) -> None:
        """Plan every interval until `stop` (rounds run only while the policy plans)."""
        self._task = asyncio.create_task(self._loop(), name="autoscaler")

    async def stop(self) -> None:
        """Stop planning; cancel the actions in flight (their rollbacks run)."""
        tasks = [t for t in [self._task, *self.tasks] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not self.policy.plans:
                continue
            try:
                self.round()
            except Exception:
                log.exception("scaling round failed")

    def snapshot(self) -> Snapshot:
        """The cluster as the planner sees it now."""
        now = self.host.clock()
        live = [h for h in self.host.replicas.values() if h.state.alive]
        # KV of prefilled batches still on prefill replicas: what the decode side must take in
        migrating = sum(h.state.used_blocks * h.block_size for h in live if h.state.role in PREFILL_LIKE)
        waiting_requests, waiting_tokens = self.host.queued()
        return Snapshot(
            now=now, replicas=tuple(self._sample(h) for h in live), waiting_prefill_tokens=waiting_tokens,
            waiting_requests=waiting_requests, migrating_tokens=migrating,
            arriving_tokens_per_s=self.rates.arrivals.rate(now),
            surge_tokens_per_s=self.rates.surge.rate(now),
            prefill_tokens_per_s=self.rates.prefill.value, migration_tokens_per_s=self.rates.migration.value,
            prefill_up_at=self.up_at.get(Kind.PREFILL), decode_up_at=self.up_at.get(Kind.DECODE),
            decode_calm_since=self.calm_since,
        )

    def _sample(self, h: ReplicaHandle) -> ReplicaSample:
        s = h.state
        idle_since = s.since if s.role is State.IDLE else None
        busy = 1 if h.id in self.executor.busy else 0
        return ReplicaSample(h.id, s.role, s.used_blocks, s.info.num_blocks_total, busy, idle_since,
                             batch=len(s.held), tpot=self.rates.tpot(h.id), tp=s.info.tp_size)

    def poke(self) -> None:
        """The queue or the arrivals changed: plan now if the snapshot says prefill is urgent
        (`triggers.urgency`), at most once per URGENT_GAP_S (a scale-up in flight quiets it)."""
        now = self.host.clock()
        if not self.policy.plans or now - self._last_urgent < URGENT_GAP_S:
            return
        reason = urgency(self.snapshot(), self.bounds)
        if reason is None:
            return
        self._last_urgent = now
        self.urgent_rounds += 1
        try:
            decided, actions = self.round(reason)
        except Exception:
            log.exception("urgent scaling round failed")
            return
        if not actions and decided.prefill.delta > 0 and self.on_short is not None:
            self.on_short(reason)

    def round(self, reason: str = "interval") -> tuple[Plan, list[Action]]:
        """One planning round: decide, start the actions, write the round (and why it ran) to the
        timeline."""
        snapshot = self.snapshot()
        bounds = self.bounds
        if self.awaited is not None and self.awaited() and bounds.min_prefill < 1:
            bounds = dataclasses.replace(bounds, min_prefill=1)
        decided = plan(snapshot, bounds)
        actions = choose(decided, snapshot, self.policy.caps)
        self.rounds += 1
        self._record(decided, actions, reason)
        for kind, delta in ((Kind.PREFILL, decided.prefill.delta), (Kind.DECODE, decided.decode.delta)):
            if delta > 0 and actions:
                self.up_at[kind] = snapshot.now
        # the calm clock: runs while rounds allow one decode replica fewer, restarts after a scale-down
        calm = decided.decode_calm and not (decided.decode.delta < 0 and actions)
        self.calm_since = (self.calm_since if self.calm_since is not None else snapshot.now) if calm else None
        for action in actions:
            self._start(action)
        return decided, actions

    def restore(self, replica: ReplicaId, role: State) -> None:
        """A replica the router had given `role` came back without weights (its process restarted as
        the inactive replica it was started as): the same member loads them again — p2p from a loaded
        replica, else from the model root — and takes `role` back, under every policy."""
        kind = _KINDS.get(role)
        if kind is None:
            log.warning("replica %s came back without weights; %s is not restored", replica, role.value)
            return
        sources = sorted(h.id for h in self.host.replicas.values() if h.id != replica and h.state.info.loaded
                         and h.state.role in HOLDS_WEIGHTS and h.id not in self.executor.busy)
        method = Method.P2P if sources else Method.LOAD_DISK
        action = Load(method, tuple(sources[:1]), (replica,), kind)
        self.timeline.write("restore", replica=replica, role=role.value, action=_describe(action))
        self._start(action)

    def start_action(self, action: Action) -> None:
        """Run one action now, outside any round (a model woken from zero, `router/pools.py`)."""
        self._start(action)

    def _start(self, action: Action) -> None:
        task = asyncio.create_task(self.executor.run(action), name=f"scale-{action_name(action)}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _record(self, decided: Plan, actions: list[Action], reason: str) -> None:
        self.timeline.write(
            "plan", policy=self.policy.name, reason=reason, loads=decided.loads,
            prefill=asdict(decided.prefill), decode=asdict(decided.decode), expire=list(decided.expire),
            actions=[_describe(a) for a in actions],
        )
        for action in actions:
            log.info("scaling: %s", _describe(action))


def _describe(action: Action) -> dict[str, object]:
    """An action as a plain record."""
    record: dict[str, object] = {"action": action_name(action)}
    if isinstance(action, Load):
        record.update(method=action.method.value, sources=list(action.sources),
                      targets=list(action.targets), kind=action.kind.value, live=action.live)
    else:
        record["replica"] = action.replica
        kind = getattr(action, "kind", None)
        if isinstance(kind, Kind):
            record["kind"] = kind.value
    return record

