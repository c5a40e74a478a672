from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_ROLE_UNSPECIFIED: _ClassVar[ReplicaRole]
    REPLICA_ROLE_PREFILL: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DECODE: _ClassVar[ReplicaRole]
    REPLICA_ROLE_COLOCATED: _ClassVar[ReplicaRole]
    REPLICA_ROLE_INACTIVE: _ClassVar[ReplicaRole]
    REPLICA_ROLE_LOADING: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DRAINING: _ClassVar[ReplicaRole]
    REPLICA_ROLE_MUTATING_TO_DECODE: _ClassVar[ReplicaRole]
    REPLICA_ROLE_IDLE: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DEAD: _ClassVar[ReplicaRole]
    REPLICA_ROLE_LOADING_DECODE: _ClassVar[ReplicaRole]
    REPLICA_ROLE_NEW_PREFILL: _ClassVar[ReplicaRole]
    REPLICA_ROLE_REFRACTORY_PREFILL: _ClassVar[ReplicaRole]
    REPLICA_ROLE_OLD_PREFILL: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DRAINING_DECODE: _ClassVar[ReplicaRole]

class MigrationStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_STRATEGY_UNSPECIFIED: _ClassVar[MigrationStrategy]
    MIGRATION_STRATEGY_FULL: _ClassVar[MigrationStrategy]
    MIGRATION_STRATEGY_PROGRESSIVE: _ClassVar[MigrationStrategy]
    MIGRATION_STRATEGY_MUTATE: _ClassVar[MigrationStrategy]
    MIGRATION_STRATEGY_RECOMPUTE: _ClassVar[MigrationStrategy]
    MIGRATION_STRATEGY_COLOCATED: _ClassVar[MigrationStrategy]

class ActivationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_METHOD_UNSPECIFIED: _ClassVar[ActivationMethod]
    ACTIVATION_METHOD_P2P: _ClassVar[ActivationMethod]
    ACTIVATION_METHOD_CHAIN: _ClassVar[ActivationMethod]
    ACTIVATION_METHOD_TANZ: _ClassVar[ActivationMethod]
    ACTIVATION_METHOD_LOAD_DISK: _ClassVar[ActivationMethod]
    ACTIVATION_METHOD_LOAD_HOST: _ClassVar[ActivationMethod]
    ACTIVATION_METHOD_HOST_PEER: _ClassVar[ActivationMethod]
REPLICA_ROLE_UNSPECIFIED: ReplicaRole
REPLICA_ROLE_PREFILL: ReplicaRole
REPLICA_ROLE_DECODE: ReplicaRole
REPLICA_ROLE_COLOCATED: ReplicaRole
REPLICA_ROLE_INACTIVE: ReplicaRole
REPLICA_ROLE_LOADING: ReplicaRole
REPLICA_ROLE_DRAINING: ReplicaRole
REPLICA_ROLE_MUTATING_TO_DECODE: ReplicaRole
REPLICA_ROLE_IDLE: ReplicaRole
REPLICA_ROLE_DEAD: ReplicaRole
REPLICA_ROLE_LOADING_DECODE: ReplicaRole
REPLICA_ROLE_NEW_PREFILL: ReplicaRole
REPLICA_ROLE_REFRACTORY_PREFILL: ReplicaRole
REPLICA_ROLE_OLD_PREFILL: ReplicaRole
REPLICA_ROLE_DRAINING_DECODE: ReplicaRole
MIGRATION_STRATEGY_UNSPECIFIED: MigrationStrategy
MIGRATION_STRATEGY_FULL: MigrationStrategy
MIGRATION_STRATEGY_PROGRESSIVE: MigrationStrategy
MIGRATION_STRATEGY_MUTATE: MigrationStrategy
MIGRATION_STRATEGY_RECOMPUTE: MigrationStrategy
MIGRATION_STRATEGY_COLOCATED: MigrationStrategy
ACTIVATION_METHOD_UNSPECIFIED: ActivationMethod
ACTIVATION_METHOD_P2P: ActivationMethod
ACTIVATION_METHOD_CHAIN: ActivationMethod
ACTIVATION_METHOD_TANZ: ActivationMethod
ACTIVATION_METHOD_LOAD_DISK: ActivationMethod
ACTIVATION_METHOD_LOAD_HOST: ActivationMethod
ACTIVATION_METHOD_HOST_PEER: ActivationMethod

class ReplicaStatus(_message.Message):
    __slots__ = ("id", "address", "role", "rank", "num_blocks_total", "num_blocks_free", "router_used_blocks", "requests", "inbound_migrations", "outbound_migrations", "registered", "last_heartbeat_age_s", "state", "state_age_s", "tp_size", "ranks", "model")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INBOUND_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    address: str
    role: ReplicaRole
    rank: int
    num_blocks_total: int
    num_blocks_free: int
    router_used_blocks: int
    requests: int
    inbound_migrations: int
    outbound_migrations: int
    registered: bool
    last_heartbeat_age_s: float
    state: str
    state_age_s: float
    tp_size: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, id: _Optional[int] = ..., address: _Optional[str] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., rank: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., router_used_blocks: _Optional[int] = ..., requests: _Optional[int] = ..., inbound_migrations: _Optional[int] = ..., outbound_migrations: _Optional[int] = ..., registered: _Optional[bool] = ..., last_heartbeat_age_s: _Optional[float] = ..., state: _Optional[str] = ..., state_age_s: _Optional[float] = ..., tp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("strategy", "queue_depth", "queue_prompt_tokens", "active_requests", "requests_finished", "requests_failed", "requests_cancelled", "generated_tokens", "migrations", "migration_bytes", "requests_requeued", "strategy_name", "scaling_policy", "scaling_actions", "scaling_failures", "model")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_NAME_FIELD_NUMBER: _ClassVar[int]
    SCALING_POLICY_FIELD_NUMBER: _ClassVar[int]
    SCALING_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FAILURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    strategy: MigrationStrategy
    queue_depth: int
    queue_prompt_tokens: int
    active_requests: int
    requests_finished: int
    requests_failed: int
    requests_cancelled: int
    generated_tokens: int
    migrations: int
    migration_bytes: int
    requests_requeued: int
    strategy_name: str
    scaling_policy: str
    scaling_actions: int
    scaling_failures: int
    model: str
    def __init__(self, strategy: _Optional[_Union[MigrationStrategy, str]] = ..., queue_depth: _Optional[int] = ..., queue_prompt_tokens: _Optional[int] = ..., active_requests: _Optional[int] = ..., requests_finished: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., migrations: _Optional[int] = ..., migration_bytes: _Optional[int] = ..., requests_requeued: _Optional[int] = ..., strategy_name: _Optional[str] = ..., scaling_policy: _Optional[str] = ..., scaling_actions: _Optional[int] = ..., scaling_failures: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("address", "role", "model")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: ReplicaRole
    model: str
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., model: _Optional[str] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("replica_id", "heartbeat_interval_s", "heartbeat_timeout_s")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    def __init__(self, replica_id: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    def __init__(self, replica_id: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("replica_id", "role")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    role: ReplicaRole
    def __init__(self, replica_id: _Optional[int] = ..., role: _Optional[_Union[ReplicaRole, str]] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    def __init__(self, replica_id: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ...) -> None: ...

class ActivateReplicaRequest(_message.Message):
    __slots__ = ("replica_ids", "role", "method", "source_ids")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IDS_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[int]
    role: ReplicaRole
    method: ActivationMethod
    source_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, replica_ids: _Optional[_Iterable[int]] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., method: _Optional[_Union[ActivationMethod, str]] = ..., source_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ActivateReplicaResponse(_message.Message):
    __slots__ = ("replicas", "seconds")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    seconds: float
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., seconds: _Optional[float] = ...) -> None: ...

class SetMigrationStrategyRequest(_message.Message):
    __slots__ = ("strategy", "name", "model")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    strategy: MigrationStrategy
    name: str
    model: str
    def __init__(self, strategy: _Optional[_Union[MigrationStrategy, str]] = ..., name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class SetMigrationStrategyResponse(_message.Message):
    __slots__ = ("previous", "previous_name")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_NAME_FIELD_NUMBER: _ClassVar[int]
    previous: MigrationStrategy
    previous_name: str
    def __init__(self, previous: _Optional[_Union[MigrationStrategy, str]] = ..., previous_name: _Optional[str] = ...) -> None: ...

class SetScalingPolicyRequest(_message.Message):
    __slots__ = ("name", "model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class SetScalingPolicyResponse(_message.Message):
    __slots__ = ("previous",)
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    previous: str
    def __init__(self, previous: _Optional[str] = ...) -> None: ...
