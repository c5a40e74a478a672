"""The admin gRPC service `router.v1.RouterAdmin` (protos/router.proto), with reflection and health.

Thin: each method checks the token (mutating calls), converts, calls the scheduler or
`router.control`, and maps our exceptions to precise status codes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from router import control, strategies
from router.admin_host_peer import activate_from_host_copies
from router.errors import ReplicaCallError
from router.pools import ModelPools
from router.registry import ReplicaHandle
from router.replicas import State, TransitionError
from router.scaling.executor import ACTION_NAMES
from router.scheduler import ClusterScheduler
from router.security import RouterTls
from router.strategies import Strategy
from router.weights import Method

log = logging.getLogger("pdcluster.router")

TOKEN_METADATA = "x-admin-token"

_ROLES = {
    State.PREFILL: pb.REPLICA_ROLE_PREFILL, State.DECODE: pb.REPLICA_ROLE_DECODE,
    State.COLOCATED: pb.REPLICA_ROLE_COLOCATED, State.INACTIVE: pb.REPLICA_ROLE_INACTIVE,
    State.LOADING_PREFILL: pb.REPLICA_ROLE_LOADING, State.DRAINING_PREFILL: pb.REPLICA_ROLE_DRAINING,
    State.MUTATING_TO_DECODE: pb.REPLICA_ROLE_MUTATING_TO_DECODE, State.IDLE: pb.REPLICA_ROLE_IDLE,
    State.DEAD: pb.REPLICA_ROLE_DEAD, State.LOADING_DECODE: pb.REPLICA_ROLE_LOADING_DECODE,
    State.NEW_PREFILL: pb.REPLICA_ROLE_NEW_PREFILL,
    State.REFRACTORY_PREFILL: pb.REPLICA_ROLE_REFRACTORY_PREFILL,
    State.OLD_PREFILL: pb.REPLICA_ROLE_OLD_PREFILL, State.DRAINING_DECODE: pb.REPLICA_ROLE_DRAINING_DECODE,
}
_ROLES_BACK: dict[int, State] = {int(v): k for k, v in _ROLES.items()}
# The built-in strategies have enum values; a plug-in goes by its name only (UNSPECIFIED here).
_STRATEGIES: dict[str, pb.MigrationStrategy] = {
    Strategy.FULL.value: pb.MIGRATION_STRATEGY_FULL,
    Strategy.PROGRESSIVE.value: pb.MIGRATION_STRATEGY_PROGRESSIVE,
    Strategy.MUTATE.value: pb.MIGRATION_STRATEGY_MUTATE,
    Strategy.RECOMPUTE.value: pb.MIGRATION_STRATEGY_RECOMPUTE,
    Strategy.COLOCATED.value: pb.MIGRATION_STRATEGY_COLOCATED,
}


def stats(scheds: Sequence[ClusterScheduler], model: str) -> pb.StatsResponse:
    """The figures of `scheds` (one model's, or every model's with `model` ""): queues and requests
    summed, counters read for `model` (every model's series with ""), the strategy and scaling policy
    of the first."""
    first = scheds[0]
    labels = {"model": model} if model else {}

    def total(name: str, **more: str) -> int:
        return int(first.metrics.total(name, {**labels, **more}))

    names = strategies.names()
    return pb.StatsResponse(
        strategy=_STRATEGIES.get(first.strategy.name, pb.MIGRATION_STRATEGY_UNSPECIFIED),
        strategy_name=first.strategy.name, model=model,
        queue_depth=sum(len(s.queue) for s in scheds),
        queue_prompt_tokens=sum(s.queue.waiting_prompt_tokens() for s in scheds),
        active_requests=sum(len(s.requests) for s in scheds),
        requests_finished=total("pdcluster_requests_total", outcome="finished"),
        requests_failed=total("pdcluster_requests_total", outcome="failed"),
        requests_cancelled=total("pdcluster_requests_total", outcome="cancelled"),
        generated_tokens=total("pdcluster_generated_tokens_total"),
        migrations=sum(total("pdcluster_migrations_total", strategy=s) for s in names),
        migration_bytes=sum(total("pdcluster_migration_bytes_total", strategy=s) for s in names),
        requests_requeued=total("pdcluster_requests_requeued_total"),
        scaling_policy=first.scaling.policy.name,
        scaling_actions=sum(total("pdcluster_scaling_actions_total", action=a) for a in ACTION_NAMES),
        scaling_failures=sum(total("pdcluster_scaling_actions_total", action=a, outcome="failed")
                             for a in ACTION_NAMES),
    )

_STRATEGIES_BACK: dict[int, str] = {int(v): k for k, v in _STRATEGIES.items()}
_METHODS: dict[int, Method] = {
    pb.ACTIVATION_METHOD_P2P: Method.P2P, pb.ACTIVATION_METHOD_CHAIN: Method.CHAIN,
    pb.ACTIVATION_METHOD_TANZ: Method.TANZ, pb.ACTIVATION_METHOD_LOAD_DISK: Method.LOAD_DISK,
    pb.ACTIVATION_METHOD_LOAD_HOST: Method.LOAD_HOST, pb.ACTIVATION_METHOD_HOST_PEER: Method.HOST_PEER,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def rpc(mutating: bool) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    """Token check for mutating calls, and our exceptions → status codes."""
    def wrap(method: Handler[Req, Resp]) -> Handler[Req, Resp]:
        @functools.wraps(method)
        async def inner(self: AdminService, request: Req, context: grpc.aio.ServicerContext) -> Resp:
            if mutating and self.token and _token(context) != self.token:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing x-admin-token")
            try:
                return await method(self, request, context)
            except KeyError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            except TransitionError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except ReplicaCallError as exc:
                code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNAVAILABLE)
                await context.abort(code, str(exc))
            raise AssertionError("unreachable: abort raises")
        return inner
    return wrap


def _token(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_METADATA:
            return str(value)
    return None


def _role(value: int, default: State | None = None) -> State:
    if value == pb.REPLICA_ROLE_UNSPECIFIED and default is not None:
        return default
    if value not in _ROLES_BACK:
        raise ValueError(f"invalid role {value}")
    return _ROLES_BACK[value]


def replica_status(hub: ClusterScheduler, h: ReplicaHandle, model: str = "") -> pb.ReplicaStatus:
    """One replica as a message (`model`: the model whose scheduler holds it)."""
    s = h.state
    age = hub.heartbeats.age(s.id, hub.clock())
    return pb.ReplicaStatus(
        id=s.id, address=s.address, role=_ROLES[s.role], rank=s.info.rank,
        num_blocks_total=s.info.num_blocks_total, num_blocks_free=s.info.num_blocks_free,
        router_used_blocks=s.used_blocks, requests=len(s.held), inbound_migrations=s.inbound,
        outbound_migrations=s.outbound, registered=s.registered,
        last_heartbeat_age_s=-1.0 if age is None else age, state=s.role.value,
        state_age_s=max(0.0, hub.clock() - s.since), tp_size=s.info.tp_size, ranks=list(s.info.ranks),
        model=model or hub.config.served_model_id,
    )


class AdminService(pb_grpc.RouterAdminServicer):
    """`router.v1.RouterAdmin` over one scheduler, or over every model's (`pools`: ListReplicas lists
    each model's replicas and the spare pool; calls naming a replica address the model holding it;
    Stats, RegisterReplica and the strategy and policy calls take a `model`, "" meaning every model
    — for RegisterReplica the one its weights are of, the first, `hub`, without weights)."""

    def __init__(self, hub: ClusterScheduler, token: str = "", pools: ModelPools | None = None) -> None:
        self.hub = hub
        self.token = token
        self.pools = pools

    def _models(self) -> dict[str, ClusterScheduler]:
        """Every model's scheduler by name (one: the router's own)."""
        if self.pools is None:
            return {self.hub.config.served_model_id: self.hub}
        return self.pools.schedulers

    def _model(self, name: str) -> list[ClusterScheduler]:
        """Model `name`'s scheduler, or every model's for "" (the first first); KeyError (NOT_FOUND)
        for a model this router does not serve."""
        models = self._models()
        if not name:
            return list(models.values())
        if name not in models:
            raise KeyError(f"no model {name!r} (served: {', '.join(models)})")
        return [models[name]]

    async def _pool_of(self, address: str, model: str) -> ClusterScheduler:
        """The scheduler a registering replica joins: the named model's, else the model its weights
        are of (Info), else the first model's."""
        if model or self.pools is None:
            return self._model(model)[0]
        client = self.hub.connect(address)
        try:
            info = await client.info()
        finally:
            await client.close()
        held = info.weights_model or info.model_id
        found = [s for s in self._models().values()
                 if held in (s.config.served_model_id, s.config.model.name)]
        if info.loaded and not found:
            raise ValueError(f"replica {address} holds model {held!r}, which this router does not serve "
                             f"({', '.join(self._models())})")
        return found[0] if info.loaded else self.hub

    def _holder(self, replica_id: int) -> ClusterScheduler:
        """The scheduler holding replica `replica_id` (ids are unique router-wide); the first model's
        when none does (its calls then answer NOT_FOUND)."""
        return next((s for s in self._models().values() if replica_id in s.replicas), self.hub)

    @rpc(mutating=False)
    async def ListReplicas(self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ListReplicasResponse:
        models = self._models()
        if request.model and request.model not in models:
            raise KeyError(f"no model {request.model!r} (served: {', '.join(models)})")
        statuses = [replica_status(sched, h, name) for name, sched in models.items()
                    if request.model in ("", name) for h in sched.replicas.values()]
        if self.pools is not None and not request.model:
            statuses += [pb.ReplicaStatus(address=a, role=pb.REPLICA_ROLE_INACTIVE, model="",
                                          state=State.INACTIVE.value, last_heartbeat_age_s=-1.0)
                         for a in self.pools.spare]
        return pb.ListReplicasResponse(replicas=statuses)

    @rpc(mutating=False)
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return stats(self._model(request.model), request.model)

    @rpc(mutating=True)
    async def RegisterReplica(self, request: pb.RegisterReplicaRequest, context: grpc.aio.ServicerContext
                              ) -> pb.RegisterReplicaResponse:
        if not request.address:
            raise ValueError("address is required")
        sched = await self._pool_of(request.address, request.model)
        rid = await sched.add_replica(request.address, _role(request.role, State.DECODE), registered=True)
        cfg = sched.config
        return pb.RegisterReplicaResponse(replica_id=rid, heartbeat_interval_s=cfg.heartbeat_interval,
                                          heartbeat_timeout_s=cfg.heartbeat_timeout)

    @rpc(mutating=True)
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatResponse:
        hub = self._holder(request.replica_id)
        return pb.HeartbeatResponse(known=hub.heartbeat(request.replica_id))  # type: ignore[arg-type]

    @rpc(mutating=True)
    async def SetRole(self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext
                      ) -> pb.SetRoleResponse:
        hub = self._holder(request.replica_id)
        await control.set_role(hub, request.replica_id, _role(request.role))
        h = control.handle_of(hub, request.replica_id)
        return pb.SetRoleResponse(replica=replica_status(hub, h))

    @rpc(mutating=True)
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        hub = self._holder(request.replica_id)
        control.drain(hub, request.replica_id)
        h = control.handle_of(hub, request.replica_id)
        return pb.DrainResponse(replica=replica_status(hub, h))

    @rpc(mutating=True)
    async def ActivateReplica(self, request: pb.ActivateReplicaRequest, context: grpc.aio.ServicerContext
                              ) -> pb.ActivateReplicaResponse:
        method = _METHODS.get(request.method)
        role = _role(request.role, State.DECODE)
        hub = self._holder(request.replica_ids[0]) if request.replica_ids else self.hub
        if method is Method.HOST_PEER:
            seconds = await activate_from_host_copies(hub, self.pools, list(request.replica_ids), role,
                                                      list(request.source_ids), self._holder)
        else:
            seconds = await control.activate(hub, list(request.replica_ids), role, method,
                                             list(request.source_ids))
        handles = [control.handle_of(hub, i) for i in request.replica_ids]
        return pb.ActivateReplicaResponse(replicas=[replica_status(hub, h) for h in handles], seconds=seconds)

    @rpc(mutating=True)
    async def SetMigrationStrategy(self, request: pb.SetMigrationStrategyRequest,
                                   context: grpc.aio.ServicerContext) -> pb.SetMigrationStrategyResponse:
        name = request.name or _STRATEGIES_BACK.get(request.strategy)
        if name is None:
            raise ValueError(f"invalid strategy {request.strategy}")
        strategies.get(name)  # ValueError for an unknown name, before any model changes
        scheds = self._model(request.model)
        previous = scheds[0].set_strategy(name).name
        for sched in scheds[1:]:
            sched.set_strategy(name)
        return pb.SetMigrationStrategyResponse(
            previous=_STRATEGIES.get(previous, pb.MIGRATION_STRATEGY_UNSPECIFIED),
            previous_name=previous)

    @rpc(mutating=True)
    async def SetScalingPolicy(self, request: pb.SetScalingPolicyRequest,
                               context: grpc.aio.ServicerContext) -> pb.SetScalingPolicyResponse:
        scheds = self._model(request.model)
        previous = scheds[0].scaling.set_policy(request.name)  # ValueError for an unknown name
        for sched in scheds[1:]:
            sched.scaling.set_policy(request.name)
        return pb.SetScalingPolicyResponse(previous=previous)


def server_credentials(tls: RouterTls) -> grpc.ServerCredentials | None:
    """TLS of the admin server (client certificates required with `tls.client_ca`); None = plaintext."""
    pair = tls.key_pair()
    if pair is None:
        return None
    client_ca = tls.pem(tls.client_ca)
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


async def start_admin_server(hub: ClusterScheduler, host: str, port: int, token: str = "",
                             tls: RouterTls | None = None,
                             pools: ModelPools | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve RouterAdmin + reflection + grpc.health.v1 on host:port (0 = free port; TLS with
    `tls.cert`; `pools`: a router with several models); returns the port."""
    server = grpc.aio.server()
    pb_grpc.add_RouterAdminServicer_to_server(AdminService(hub, token, pools), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["RouterAdmin"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    credentials = server_credentials(tls) if tls is not None else None
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot bind the admin server to {host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(names[0], health_pb2.HealthCheckResponse.SERVING)
    return server, bound
