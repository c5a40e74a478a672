"""The scheduling core's hub: it owns the parts and wires them (implements `types.Scheduler` for the
front end and `cluster.Cluster` for the replica loops).

```
 submit ─► Requests (lifecycle.py: queue, streams) ─► ReplicaWorker per replica (loops.py)
                ▲ re-run (a replica died)                 │ prefill ─► Migrations (migration.py)
                │                                         │   strategy (strategies/) ─► inbox of D
   mark_dead ◄── heartbeats / UNAVAILABLE                 ▼ decode (decoding.py) ─► events
                          Replicas (registry.py: states, roles, clients, inboxes)
```
Everything runs on one asyncio loop; state changes happen between awaits, so no locks are needed.
Loops and migration tasks sleep on their own wake-ups (`wakeup.Wakeups`): a change wakes the tasks
it gives work to, a change of roles or of the strategy wakes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from router import strategies
from router.batches import LiveBatch, Member
from router.cluster import LoopLimits
from router.config import RouterConfig
from router.errors import PeerFailed, ReplicaCallError, ReplicaRejected, ReplicaUnavailable, out_of_pages
from router.lifecycle import Requests
from router.links import PeerLinks
from router.loops import ReplicaWorker
from router.metrics import RouterMetrics
from router.migration import Migrations
from router.prefix_routing import PrefixRouting
from router.queue import Budgets, RequestQueue
from router.registry import ReplicaHandle, Replicas, fabric_conflict
from router.replica_api import Connect, ReplicaApi
from router.replicas import SERVING, Heartbeats, ReplicaState, ReplicaView, State, Trigger
from router.requests import RequestStream, now
from router.routing import Routing
from router.scaling.autoscaler import Autoscaler
from router.scaling.rates import Rates
from router.scaling.timeline import Timeline
from router.states import HOLDS_WEIGHTS
from router.strategies.base import MigrationStrategy, Mode
from router.types import BatchId, GenerateRequest, ReplicaId, RequestId, StepResult, TokenDecoder
from router.wakeup import Wakeups

log = logging.getLogger("pdcluster.router")


@dataclass(frozen=True)
class ClusterView:
    """The cluster at one instant, as a planner reads it: O(replicas) to take."""

    replicas: tuple[ReplicaView, ...]
    queued_requests: int
    queued_prompt_tokens: int
    active_requests: int
    strategy: str


class ClusterScheduler:
    """Owns the requests, the replicas, their loops and the migration queue."""

    def __init__(self, config: RouterConfig, decoder: TokenDecoder, connect: Connect,
                 metrics: RouterMetrics | None = None, kv_bytes_per_token: int = 0,
                 clock: Callable[[], float] = now, ids: Iterator[int] | None = None) -> None:
        self.config = config
        self.metrics = (metrics or RouterMetrics()).for_model(config.served_model_id)
        self.clock = clock
        self.wakeups = Wakeups()
        self.replicas = Replicas(ids)
        self.replicas.on_move = self._moved
        self.replicas.on_info = self._info
        self.prefix = PrefixRouting(Routing(config.routing), config.routing_max_load, self.metrics)
        self.requests = Requests(self.metrics, clock, decoder, self.wakeups, config.max_requeues)
        self.heartbeats = Heartbeats(config.heartbeat_timeout)
        self._strategy = strategies.get(config.strategy)
        self.rates = Rates(config.prefill_tokens_per_s, config.migration_tokens_per_s,
                           surge_window=config.surge_window)
        self.timeline = Timeline(config.timeline, clock)
        self.links = PeerLinks(config.peer_connect_timeout, self.timeline.write)
        self._moves = Migrations(self, self.replicas, self.requests, self.wakeups, self.metrics, clock,
                                 config.max_inbound_migrations, kv_bytes_per_token, self.rates)
        self._connect = connect
        self._limits = LoopLimits(config.max_pending_migrations, config.max_batch_prefill_tokens,
                                  config.chunk_tokens, config.prefill_chunk_share)
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False
        self.weight_bytes = 0  # one replica's weights (main.py sets it from the checkpoint)
        self.scaling = Autoscaler(self, config.scaling, config.bounds(), config.plan_interval, self.rates,
                                  self.timeline, self.metrics.scaling_action)

    @property
    def queue(self) -> RequestQueue:
        """Requests waiting for a prefill."""
        return self.requests.queue

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (the bytes a migration moves per token)."""
        return self._moves.kv_bytes_per_token

    @kv_bytes_per_token.setter
    def kv_bytes_per_token(self, value: int) -> None:
        self._moves.kv_bytes_per_token = value

    # ---- Scheduler (the front end) ------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Validate against the replicas' limits, queue, and return the request's event stream."""
        stream = self.requests.submit(request, self.replicas.limits())
        self.rates.arrived(len(request.input_ids), self.clock())
        self.scaling.poke()  # a step in load is planned for at once, not at the next round
        return stream

    def is_healthy(self) -> bool:
        """True when at least one live replica serves."""
        return self.replicas.limits().replicas > 0

    # ---- Cluster (the replica loops) ----------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """The router is shutting down."""
        return self._stopping

    @property
    def strategy(self) -> MigrationStrategy:
        """The migration strategy for batches cut from now on."""
        return self._strategy

    @property
    def moves(self) -> Migrations:
        """The migration queue."""
        return self._moves

    def has_decode(self) -> bool:
        """A live decode replica exists."""
        return self.replicas.has_decode()

    def zigzag_replicas(self) -> list[ReplicaHandle]:
        """Replicas prefilling layer by layer while (or just after) their weights arrive."""
        return [h for h in self.replicas.values()
                if h.state.role in (State.NEW_PREFILL, State.REFRACTORY_PREFILL)]

    def record(self, kind: str, **fields: object) -> None:
        """Write a record to the router's timeline (`--timeline`)."""
        self.timeline.write(kind, **fields)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill call of `tokens` prompt tokens took `seconds` (the planner's prefill speed)."""
        self.rates.prefilled(tokens, seconds)

    def queued(self) -> tuple[int, int]:
        """Requests and prompt tokens waiting for a prefill."""
        return len(self.queue), self.queue.waiting_prompt_tokens()

    @property
    def model_name(self) -> str:
        """The checkpoint's folder name (what LoadParams loads under a replica's model root)."""
        return self.config.model.name

    def take_batch(self, replica: ReplicaHandle) -> tuple[BatchId, list[Member]] | None:
        """The next batch from the queue that fits `replica`, of the prompts the routing rule gives it
        (`--routing`; prompts it leaves for another replica wake that replica's loop)."""
        c = self.config
        budgets = Budgets(c.max_batch_prefill_tokens, c.max_batch_total_tokens, replica.state.free_blocks,
                          replica.block_size, c.max_batch_size)
        accept = self.prefix.wants(replica.state, self._prefill_candidates(), self.wakeups.replica)
        taken = self.requests.take(budgets, accept)
        return None if taken is None else (taken[0].id, taken[1])

    def _prefill_candidates(self) -> list[ReplicaState]:
        """Live replicas whose loop takes batches from the queue under the current strategy."""
        has_decode = self.replicas.has_decode()
        takes = (Mode.PREFILL, Mode.COLOCATED)
        return [h.state for h in self.replicas.values()
                if h.state.alive and self._strategy.mode(h.state.role, has_decode) in takes]

    def prefill_done(self, replica: ReplicaHandle, members: Iterable[Member], result: StepResult) -> None:
        """`replica` prefilled `members` (the prefix index and the hit-rate metrics learn of it)."""
        self.prefix.prefilled(replica.state, members, result)

    def decode_preference(self, live: LiveBatch, receivers: Sequence[ReplicaState], need: int,
                          chosen: ReplicaState) -> ReplicaState:
        """A migrating batch's decode replica by the routing rule (`chosen`: the strategy's pick)."""
        return self.prefix.destination(live.members.values(), receivers, need,
                                       self.config.max_inbound_migrations, chosen)

    def kv_arrived(self, replica: ReplicaHandle, live: LiveBatch) -> None:
        """A batch's prompt KV is on `replica` now (the prefix index learns of it)."""
        self.prefix.migrated(replica.state, live.members.values(), live.cached.evicted_page_hashes)

    def step_done(self, replica: ReplicaHandle, result: StepResult) -> None:
        """A decode step on `replica` answered (the prefix index drops what it evicted; the
        planner's TPOT is the interval between steps)."""
        self.prefix.stepped(replica.id, result)
        self.rates.stepped(replica.id, self.clock(), continuing=result.batch is not None)

    def new_batch_id(self) -> BatchId:
        """An unused batch id."""
        return self.requests.queue.batch_ids.next()

    def deliver(self, result: StepResult, members: Mapping[RequestId, Member]) -> None:
        """Stream one step's generations to their requests."""
        self.requests.deliver(result, members)

    def on_error(self, handle: ReplicaHandle, exc: ReplicaCallError, members: Iterable[Member]) -> None:
        """A call on `handle` failed: a dead replica re-runs its requests, and so does a replica whose
        transfer peer failed (it is alive: the peer is marked dead by its own calls or heartbeats); a
        replica out of pages gets them again once it freed what the router released; any other
        error fails them."""
        if isinstance(exc, ReplicaUnavailable):
            self.mark_dead(handle.id, str(exc))
            self.requests.requeue(members, str(exc))
        elif isinstance(exc, PeerFailed):
            log.warning("batch failed on replica %s because of its peer: %s", handle.id, exc)
            self.requests.requeue(members, str(exc))
        elif out_of_pages(exc):
            log.warning("replica %s had no room for a batch the router counted room for: %s", handle.id, exc)
            handle.state.page_sync = True
            self.requests.retry(members, str(exc))
        else:
            log.warning("batch failed on replica %s: %s", handle.id, exc)
            message = f"replica {handle.id} failed the batch: {exc.code}: {exc.details}"
            self.requests.fail(members, message, 502)

    def settle_roles(self) -> None:
        """Keep a prefill replica in a disaggregated cluster: an empty decode replica takes the role."""
        if not self._strategy.colocates and self.replicas.settle_roles() is not None:
            self.wakeups.all()

    # ---- replicas ----------------------------------------------------------------------------------

    def connect(self, address: str) -> ReplicaApi:
        """A new client of the replica at `address` (the caller closes it)."""
        return self._connect(address)

    async def add_replica(self, address: str, role: State, registered: bool = False) -> ReplicaId:
        """Connect to a replica, read its Info and start its loop."""
        client = self._connect(address)
        # Whatever a joining replica holds is nobody's: this router has sent it nothing yet. It may
        # hold batches of a router that died (restarted against the same replicas), or of its own
        # earlier life here (declared dead, registering again: those requests re-ran elsewhere).
        # Left cached, their pages would be lost to every later batch.
        with contextlib.suppress(ReplicaCallError):
            await client.clear_cache()
        info = await client.info()
        conflict = fabric_conflict(address, info, (h.state for h in self.replicas.values()))
        if conflict is not None:
            log.error("%s", conflict)
            await client.close()
            raise ReplicaRejected(address, "Info", "FAILED_PRECONDITION", conflict)
        if role in SERVING and not info.loaded:
            log.warning("replica %s has no weights loaded: registering it inactive", address)
            role = State.INACTIVE
        handle = self.replicas.add(address, info, role, client, registered)
        self.prefix.info(handle.id, info)
        handle.state.since = self.clock()
        self.timeline.write("replica", replica=handle.id, address=address, state=role, rank=info.rank)
        self._start_loop(handle)
        self.links.joined(handle, [h for h in self.replicas.values() if h.state.alive])
        return handle.id

    def _moved(self, state: ReplicaState, old: State, new: State, trigger: Trigger) -> None:
        """Every replica state change: stamp it, log it, write it to the timeline and the gauges,
        and wake every loop and hand-off (what each may do follows the roles)."""
        state.since = self.clock()
        log.info("replica %s: %s -> %s (%s)", state.id, old.value, new.value, trigger.value)
        self.timeline.write("transition", replica=state.id, source=old, target=new, trigger=trigger)
        self.metrics.update_replicas([state])
        self.metrics.count_states((h.state.role for h in self.replicas.values()), self.config.served_model_id)
        self.wakeups.all()

    def _info(self, state: ReplicaState) -> None:
        """A replica's Info replaced the router's: rebuild its prefix index entry from it."""
        self.prefix.info(state.id, state.info)

    def _start_loop(self, handle: ReplicaHandle) -> None:
        self.heartbeats.beat(handle.id, self.clock())
        worker = ReplicaWorker(self, handle, self.wakeups, self._limits)
        handle.task = asyncio.create_task(worker.run(), name=f"replica-{handle.id}")
        self.metrics.update_replicas([handle.state])
        self.wakeups.all()

    def notify(self) -> None:
        """Something changed (roles, pages): wake every waiting loop and hand-off."""
        self.wakeups.all()

    def heartbeat(self, rid: ReplicaId) -> bool:
        """A registered replica is alive; False when unknown or already declared dead."""
        handle = self.replicas.get(rid)
        if handle is None or not handle.state.alive:
            return False
        self.heartbeats.beat(rid, self.clock())
        return True

    def set_strategy(self, name: str | strategies.Strategy) -> MigrationStrategy:
        """Switch the migration strategy for batches prefilled from now on; returns the previous one."""
        previous, self._strategy = self._strategy, strategies.get(name)
        log.info("migration strategy: %s -> %s", previous.name, self._strategy.name)
        self.settle_roles()
        self.wakeups.all()
        return previous

    def mark_dead(self, rid: ReplicaId, reason: str) -> None:
        """The replica is gone: stop its loop and re-run every request it held."""
        handle = self.replicas.get(rid)
        if handle is None or not handle.state.alive:
            return
        log.warning("replica %s (%s) is dead: %s", rid, handle.state.address, reason)
        handle.state.move(State.DEAD, Trigger.DIED)
        self.heartbeats.forget(rid)
        self.prefix.dead(rid)
        if handle.task is not None and handle.task is not asyncio.current_task():
            handle.task.cancel()
        on_it = self.requests.on(rid)
        handle.forget_work()
        handle.state.release_all()
        self.requests.requeue(on_it, f"replica {rid} died")
        self.settle_roles()
        if not self.replicas.can_serve():
            self.requests.fail_queued(f"no replica is left to serve it (the last one, {rid}, died)")

    def snapshot(self) -> ClusterView:
        """The replicas' states and the queue now, frozen."""
        queue = self.requests.queue
        return ClusterView(self.replicas.snapshot(), len(queue), queue.waiting_prompt_tokens(),
                           len(self.requests), self._strategy.name)

    # ---- start, stop, liveness ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the liveness monitor."""
        self._monitor = asyncio.create_task(self._watch(), name="replica-monitor")
        self.metrics.count_states((h.state.role for h in self.replicas.values()), self.config.served_model_id)
        self.scaling.start()

    async def stop(self) -> None:
        """Stop every loop and close the clients; requests still running fail."""
        self._stopping = True
        await self.scaling.stop()
        await self.links.stop()
        tasks = [t for t in [self._monitor, *(h.task for h in self.replicas.values())] if t is not None]
        tasks += list(self._moves.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self.requests.fail_all("the router is shutting down")
        for handle in self.replicas.values():
            await handle.client.close()
        self.timeline.close()

    async def _watch(self) -> None:
        interval = self.config.heartbeat_interval
        while not self._stopping:
            asleep = self.clock()
            await asyncio.sleep(interval)
            await self.check_liveness(late=self.clock() - asleep - interval)

    async def check_liveness(self, late: float = 0.0) -> None:
        """Poll Info of replicas that do not send heartbeats (dead ones too: they come back when they
        answer again); expire replicas past their deadline. A stall of the router itself (`late`: s
        its monitor woke past its time; a poll that timed out well past its timeout) is credited to
        every replica first: a router that could not listen convicts nobody for that time."""
        polled = [h for h in self.replicas.values() if not h.state.registered]
        polls = await asyncio.gather(*(self._poll(h) for h in polled), return_exceptions=True)
        slept_late = late if late > self._stall_slack else 0.0
        stalled = slept_late + max((s for s in polls if isinstance(s, float)), default=0.0)
        if stalled:
            log.warning("the router stalled %.2f s: credited to every replica's heartbeat deadline", stalled)
            self.heartbeats.stalled(stalled, self.clock())
        for rid in self.heartbeats.expired(self.clock()):
            self.mark_dead(rid, "missed its heartbeat deadline")
        self.metrics.update_replicas(h.state for h in self.replicas.values())

    @property
    def _stall_slack(self) -> float:
        """How late the router's own timers may run before it counts as stalled."""
        return self.config.heartbeat_interval / 2

    async def _poll(self, handle: ReplicaHandle) -> float:
        """Poll one replica's Info; the seconds the router was stalled meanwhile (a poll that timed
        out past its timeout by more than the slack was no fair poll: all of it), else 0."""
        before = (handle.state.role, handle.state.since)
        timeout = self.config.heartbeat_interval * 2
        sent = self.clock()
        try:
            info = await asyncio.wait_for(handle.client.info(), timeout)
        except TimeoutError:
            took = self.clock() - sent
            return took if took - timeout > self._stall_slack else 0.0
        except ReplicaCallError:
            return 0.0
        handle.state.info = info
        if handle.state.alive and handle.state.process and info.instance not in ("", handle.state.process):
            self.mark_dead(handle.id, "another process answers on its address: it restarted")
        elif handle.state.alive and self._restarted(handle, before):
            self.mark_dead(handle.id, "it answers without the weights it held: its process restarted")
        if handle.state.alive:
            self.heartbeats.beat(handle.id, self.clock())
        elif not self._stopping:
            await self._revive(handle)
        return 0.0

    def _restarted(self, handle: ReplicaHandle, before: tuple[State, float]) -> bool:
        """A replica that held weights answers without them (its state unchanged across the call, no
        scaling action on it): its process restarted within the heartbeat deadline, so it is the
        same member coming back (dead, then revived: `_revive`), not a replica still serving."""
        s = handle.state
        return ((s.role, s.since) == before and s.role in HOLDS_WEIGHTS and not s.info.loaded
                and handle.id not in self.scaling.executor.busy)

    async def _revive(self, handle: ReplicaHandle) -> None:
        """A dead polled replica answers again (restarted, or its death was a glitch): free whatever it
        still holds (the router forgot it), give it back its role and restart its loop. One whose
        Health fails stays dead: a tensor-parallel group that lost a rank still answers Info (rank 0
        lives) but every step fails, for good, until it is restarted."""
        try:
            await handle.client.health()
            await handle.client.clear_cache()
        except ReplicaCallError:
            return
        if handle.state.alive:  # revived meanwhile by a concurrent poll
            return
        role = handle.state.revive(h.state.role for h in self.replicas.values())
        handle.state.process = handle.state.info.instance  # the member is this process from now on
        log.warning("replica %s (%s) answers again: back as %s", handle.id, handle.state.address, role.value)
        handle.forget_work()
        self._start_loop(handle)
        # a restart lost its connections
        self.links.joined(handle, [h for h in self.replicas.values() if h.state.alive])
        self.settle_roles()
        if handle.state.lost_role is not None:  # restarted without the weights the router gave it
            self.scaling.restore(handle.id, handle.state.lost_role)
