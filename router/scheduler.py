"""The scheduling core: requests in, replica loops and migrations out (implements `types.Scheduler`).

```
 submit ─► RequestQueue ─► prefill loop (replica P) ─► Migrations ─► inbox of D ─► decode loop (D)
             ▲  re-run (replica died)                                                  │ events
             └──────────────────────────── mark_dead ◄── heartbeats / UNAVAILABLE       ▼
                                                                              RequestStream (client)
```
Everything runs on one asyncio loop; state changes happen between awaits, so no locks are needed.
Workers and migration tasks sleep on `wait_change` and are woken by `notify`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from router.batches import Arrived, LiveBatch, Member, Reprefill, migrated_blocks
from router.client import PeerFailed, ReplicaCallError, ReplicaClient, ReplicaUnavailable, StepResult
from router.config import RouterConfig, Strategy
from router.loops import ReplicaWorker
from router.metrics import RouterMetrics
from router.migration import Migrations
from router.queue import Budgets, PlannedBatch, QueueEntry, RequestQueue, request_blocks
from router.replicas import SERVING, Heartbeats, ReplicaState, Role
from router.requests import RequestState, RequestStream, now
from router.types import GenerateRequest, ReplicaId, RequestId, RequestRejected

_CANNOT_SERVE = frozenset({Role.DEAD, Role.INACTIVE})  # no loop runs a request without an admin call

log = logging.getLogger("pdcluster.router")


@dataclass
class ReplicaHandle:
    """A replica as the core drives it: state, client, inbox of batches to decode, worker task."""

    state: ReplicaState
    client: ReplicaClient
    inbox: list[Arrived | Reprefill] = field(default_factory=list)
    running: LiveBatch | None = None
    task: asyncio.Task[None] | None = None

    @property
    def id(self) -> ReplicaId:
        """The router's id of this replica."""
        return self.state.id

    @property
    def rank(self) -> int:
        """Its global rank (for Migrate src/dst)."""
        return self.state.info.rank

    @property
    def block_size(self) -> int:
        """Tokens per KV page."""
        return self.state.info.block_size

    @property
    def empty(self) -> bool:
        """Holds nothing for us and expects nothing."""
        s = self.state
        return self.running is None and not self.inbox and not s.held and not s.inbound and not s.outbound


class ClusterScheduler:
    """Owns the queue, the replicas, their loops, migrations and request states."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None,
                 kv_bytes_per_token: int = 0, clock: Callable[[], float] = now) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.clock = clock
        self.strategy = config.strategy
        self.queue = RequestQueue()
        self.replicas: dict[ReplicaId, ReplicaHandle] = {}
        self.requests: dict[RequestId, RequestState] = {}
        self.heartbeats = Heartbeats(config.heartbeat_timeout)
        self.migrations = Migrations(self)
        self._request_ids = itertools.count(1)
        self._replica_ids = itertools.count(0)
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self.stopping = False

    # ---- wake-ups --------------------------------------------------------------------------------

    def notify(self) -> None:
        """Something changed (queue, pages, roles): wake every waiting loop."""
        self._changed.set()
        self._changed = asyncio.Event()

    def change_token(self) -> asyncio.Event:
        """Take before checking for work; `wait_change(token)` then cannot miss a `notify` in between."""
        return self._changed

    async def wait_change(self, token: asyncio.Event | None = None, timeout: float = 0.5) -> None:
        """Sleep until `notify` (since `token` was taken) or `timeout` (which keeps loops self-healing)."""
        event = token or self._changed
        if event.is_set():
            return
        # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races the wake-up.
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait([waiter], timeout=timeout)
        finally:
            waiter.cancel()

    # ---- Scheduler protocol ----------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Validate against the replicas' limits, queue, and return the request's event stream."""
        if request.truncate is not None:
            # Truncate here, as the replica would: pages, limits and re-runs then see the real prompt.
            kept = request.input_ids[-request.truncate:]
            request = dataclasses.replace(request, input_ids=kept, truncate=None)
        self._check_limits(request)
        state = RequestState(RequestId(next(self._request_ids)), request, self.clock)
        self.requests[state.id] = state
        self.queue.push(QueueEntry(state.id, request, _alive(state)))
        self._queue_gauges()
        self.notify()
        return RequestStream(state, self._closed)

    def is_healthy(self) -> bool:
        """True when at least one live replica serves."""
        return any(h.state.role in SERVING for h in self.replicas.values())

    def _check_limits(self, request: GenerateRequest) -> None:
        serving = [h.state.info for h in self.replicas.values() if h.state.role in SERVING]
        if not serving:
            raise RequestRejected("no replica is serving", 503)
        n, new = len(request.input_ids), request.stopping.max_new_tokens
        if n == 0 or new < 1:
            raise RequestRejected("a request needs at least one prompt token and max_new_tokens >= 1")
        max_in = min(i.max_input_tokens or n for i in serving)
        max_total = min(i.max_total_tokens or n + new for i in serving)
        if n > max_in:
            raise RequestRejected(f"prompt has {n} tokens, more than the limit of {max_in}")
        if n + new > max_total:
            raise RequestRejected(f"prompt + max_new_tokens = {n + new} exceeds the limit of {max_total}")
        if min(i.num_blocks_total * i.block_size for i in serving) < request_blocks(request, 1):
            raise RequestRejected("request needs more KV pages than a replica has", 400)

    def _closed(self, state: RequestState) -> None:
        self._finish(state, "cancelled")
        self.notify()

    def _finish(self, state: RequestState, outcome: str) -> None:
        if self.requests.pop(state.id, None) is None:
            return
        end = state.finished_at or self.clock()
        self.metrics.request_done(outcome, state.submitted_at, state.first_token_at, end,
                                  len(state.original.input_ids), len(state.generated))

    def _queue_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.queue))
        self.metrics.queue_tokens.set(self.queue.waiting_prompt_tokens())

    # ---- used by loops and migrations ------------------------------------------------------------

    def budgets_for(self, handle: ReplicaHandle) -> Budgets:
        """What one prefill batch on this replica may take."""
        c = self.config
        return Budgets(c.max_batch_prefill_tokens, c.max_batch_total_tokens, handle.state.free_blocks,
                       handle.block_size, c.max_batch_size)

    def next_batch(self, handle: ReplicaHandle) -> tuple[PlannedBatch, list[Member]] | None:
        """Take the next batch that fits this replica, as members at their current run."""
        planned = self.queue.next_batch(self.budgets_for(handle))
        self._queue_gauges()
        if planned is None:
            return None
        members = [Member(self.requests[e.request_id], self.requests[e.request_id].run, e.request)
                   for e in planned.entries if e.request_id in self.requests]
        return planned, members

    def deliver(self, result: StepResult, members: dict[RequestId, Member]) -> None:
        """Stream one step's generations to their requests (stale runs are ignored)."""
        tokens = 0
        for gen in result.generations:
            member = members.get(gen.request_id)
            if member is None or not member.current or not member.state.alive:
                continue
            tokens += len(gen.tokens)
            if member.state.deliver(gen):
                self._finish(member.state, "finished")
        self.metrics.generated_tokens.inc(tokens)  # once per step: a prometheus update takes a lock

    def requeue(self, members: Iterable[Member], reason: str) -> None:
        """Re-run these requests from their generated tokens on another replica (front of the queue)."""
        for member in reversed(list(members)):
            state = member.state
            if not member.current or not state.alive:
                continue
            if state.requeues >= self.config.max_requeues:
                self.fail([member], f"request failed after {state.requeues} re-runs: {reason}", 503)
                continue
            state.requeues += 1
            state.new_run()
            self.metrics.requeued.inc()
            self.queue.push_front(QueueEntry(state.id, state.current(), _alive(state)))
        self._queue_gauges()
        self.notify()

    def fail(self, members: Iterable[Member], message: str, http_status: int = 500) -> None:
        """End these requests with an error event."""
        for member in members:
            if member.current and member.state.alive:
                member.state.fail(message, http_status)
                self._finish(member.state, "failed")

    def on_error(self, handle: ReplicaHandle, exc: ReplicaCallError, members: Iterable[Member]) -> None:
        """A call on `handle` failed: a dead replica re-runs its requests, and so does a replica whose
        transfer peer failed (it is alive: the peer is marked dead by its own calls or heartbeats);
        any other error fails them."""
        if isinstance(exc, ReplicaUnavailable):
            self.mark_dead(handle.id, str(exc))
            self.requeue(members, str(exc))
        elif isinstance(exc, PeerFailed):
            log.warning("batch failed on replica %s because of its peer: %s", handle.id, exc)
            self.requeue(members, str(exc))
        else:
            log.warning("batch failed on replica %s: %s", handle.id, exc)
            self.fail(members, f"replica {handle.id} failed the batch: {exc.code}: {exc.details}", 502)

    def mark_dead(self, rid: ReplicaId, reason: str) -> None:
        """The replica is gone: stop its loop and re-run every request it held."""
        handle = self.replicas.get(rid)
        if handle is None or not handle.state.alive:
            return
        log.warning("replica %s (%s) is dead: %s", rid, handle.state.address, reason)
        handle.state.set_role(Role.DEAD)
        self.heartbeats.forget(rid)
        if handle.task is not None and handle.task is not asyncio.current_task():
            handle.task.cancel()
        on_it = [Member.now(s) for s in list(self.requests.values()) if s.replica == rid and s.alive]
        handle.inbox.clear()
        handle.running = None
        handle.state.held.clear()
        self.requeue(on_it, f"replica {rid} died")
        self.ensure_roles()
        if all(h.state.role in _CANNOT_SERVE for h in self.replicas.values()):
            self._fail_queued(f"no replica is left to serve it (the last one, {rid}, died)")

    def _fail_queued(self, message: str) -> None:
        """End every queued request with 503: nothing alive could run it (new ones are refused too)."""
        for entry in self.queue.take_all():
            state = self.requests.get(entry.request_id)
            if state is not None and state.alive:
                state.fail(message, 503)
                self._finish(state, "failed")
        self._queue_gauges()

    def ensure_roles(self) -> None:
        """Keep a prefill replica in a disaggregated cluster: an empty decode replica takes the role."""
        if self.strategy is Strategy.COLOCATED:
            return
        roles = [h.state.role for h in self.replicas.values()]
        if Role.PREFILL in roles or Role.COLOCATED in roles:
            return
        for handle in self.replicas.values():
            if handle.state.role is Role.DECODE and handle.empty:
                handle.state.set_role(Role.PREFILL)
                log.info("replica %s becomes a prefill replica", handle.id)
                self.notify()
                return

    def has_decode(self) -> bool:
        """A live decode replica exists (else prefill replicas decode their own batches)."""
        return any(h.state.role in (Role.DECODE, Role.MUTATING_TO_DECODE) for h in self.replicas.values())

    def kv_bytes(self, live: LiveBatch) -> int:
        """Bytes of KV a migration of this batch moves (all layers, whole pages of the prompts)."""
        moved = sum(migrated_blocks(m, live.block_size) for m in live.members.values())
        return moved * live.block_size * self.kv_bytes_per_token

    # ---- replicas ----------------------------------------------------------------------------------

    async def add_replica(self, address: str, role: Role, registered: bool = False) -> ReplicaId:
        """Connect to a replica, read its Info and start its loop."""
        client = ReplicaClient(address, self.config.rpc_timeout, self.config.transfer_timeout)
        # Whatever a joining replica holds is nobody's: this router has sent it nothing yet. It may
        # hold batches of a router that died (restarted against the same replicas), or of its own
        # earlier life here (declared dead, registering again: those requests re-ran elsewhere).
        # Left cached, their pages would be lost to every later batch.
        with contextlib.suppress(ReplicaCallError):
            await client.clear_cache()
        info = await client.info()
        if role in SERVING and not info.loaded:
            log.warning("replica %s has no weights loaded: registering it inactive", address)
            role = Role.INACTIVE
        rid = ReplicaId(next(self._replica_ids))
        handle = ReplicaHandle(ReplicaState(rid, address, info, role, registered), client)
        self.replicas[rid] = handle
        self._start_loop(handle)
        return rid

    def _start_loop(self, handle: ReplicaHandle) -> None:
        self.heartbeats.beat(handle.id, self.clock())
        handle.task = asyncio.create_task(ReplicaWorker(self, handle).run(), name=f"replica-{handle.id}")
        self.metrics.update_replicas([handle.state])
        self.notify()

    def heartbeat(self, rid: ReplicaId) -> bool:
        """A registered replica is alive; False when unknown or already declared dead."""
        handle = self.replicas.get(rid)
        if handle is None or not handle.state.alive:
            return False
        self.heartbeats.beat(rid, self.clock())
        return True

    def set_strategy(self, strategy: Strategy) -> None:
        """Switch the migration strategy for batches prefilled from now on."""
        log.info("migration strategy: %s -> %s", self.strategy.value, strategy.value)
        self.strategy = strategy
        self.ensure_roles()
        self.notify()

    async def start(self) -> None:
        """Start the liveness monitor."""
        self._monitor = asyncio.create_task(self._watch(), name="replica-monitor")

    async def stop(self) -> None:
        """Stop every loop and close the clients; requests still running fail."""
        self.stopping = True
        tasks = [t for t in [self._monitor, *(h.task for h in self.replicas.values())] if t is not None]
        tasks += list(self.migrations.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for state in list(self.requests.values()):
            state.fail("the router is shutting down", 503)
            self._finish(state, "failed")
        for handle in self.replicas.values():
            await handle.client.close()

    async def _watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.config.heartbeat_interval)
            await self.check_liveness()

    async def check_liveness(self) -> None:
        """Poll Info of replicas that do not send heartbeats (dead ones too: they come back when they
        answer again); expire replicas past their deadline."""
        polled = [h for h in self.replicas.values() if not h.state.registered]
        await asyncio.gather(*(self._poll(h) for h in polled), return_exceptions=True)
        for rid in self.heartbeats.expired(self.clock()):
            self.mark_dead(rid, "missed its heartbeat deadline")
        self.metrics.update_replicas(h.state for h in self.replicas.values())

    async def _poll(self, handle: ReplicaHandle) -> None:
        try:
            info = await asyncio.wait_for(handle.client.info(), self.config.heartbeat_interval * 2)
        except (ReplicaCallError, TimeoutError):
            return
        handle.state.info = info
        if handle.state.alive:
            self.heartbeats.beat(handle.id, self.clock())
        elif not self.stopping:
            await self._revive(handle)

    async def _revive(self, handle: ReplicaHandle) -> None:
        """A dead polled replica answers again (restarted, or its death was a glitch): free whatever it
        still holds (the router forgot it), give it back its role and restart its loop."""
        try:
            await handle.client.clear_cache()
        except ReplicaCallError:
            return
        if handle.state.alive:  # revived meanwhile by a concurrent poll
            return
        role = handle.state.revive(h.state.role for h in self.replicas.values())
        log.warning("replica %s (%s) answers again: back as %s", handle.id, handle.state.address, role.value)
        handle.inbox.clear()
        handle.running = None
        self._start_loop(handle)
        self.ensure_roles()


def _alive(state: RequestState) -> Callable[[], bool]:
    """The queue's liveness probe of one request."""
    return lambda: state.alive
