"""The replica's one message schema: what the gRPC edge asks of the core, and what comes back.

Every RPC of `generate.v2.TextGenerationService` becomes one of these messages at the edge
(`rpcs.py`, the only place that reads protobuf) and is answered by the core (`core.py`) with a
plain value: an engine type (`StepResult`, `CachedBatchInfo`, ...) or one of the replies below.
The same objects travel whatever the placement: handed over as they are when the edge runs in
the replica process, encoded with msgspec (msgpack) between the front process and the replica
(`frames.py`). msgspec because its encoder and typed decoder run in C: encoding a decode step on
the engine thread costs a fraction of building tuples and pickling them, and the edge gets the
engine's own types back (no second, positional encoding of a step).

```
 Call (tagged union, one per engine / service operation)   lane    reply
 Decode(inputs)                                             ENGINE  StepResult
 Prefill(batch, chunk_tokens) · PrefillChunk(batch_id, …)  ENGINE  StepResult (orphan → Clear)
 Filter(batch_id, keep) · Clear(batch_id)                   ENGINE  CachedBatchInfo · None
 Warmup(spec)                                               ENGINE  int | None
 Health() · Discover() · Info()                             SERVICE HealthState · Discovery · ReplicaInfo
 ConnectPeers(peers)                                        SERVICE tuple[PeerLink, ...]
 Migrate · MigratePartial                                   SERVICE CachedBatchInfo
 Immigrate · ImmigratePartial                               SERVICE ImmigratedBatch
 MigratingPrefill · PipelinedPrefill · ZagPrefill           SERVICE StepResult · ZagOutcome
 LoadParams · SendParams · RecvParams · Broadcast ·         SERVICE None
   WaitRdmaDone · ResetStatus · SetStatusReady
 Relay                                                      SERVICE Relayed | None
```
`lane` says where a call runs: ENGINE calls are one work item on the engine thread (in the front
placement the engine thread reads them from the socket itself); SERVICE calls run on a thread of
their own because they wait for peers or for long engine items that only such a call can unblock,
or, like Info, must answer while the engine thread runs a long item (the router's liveness poll).
`orphan(reply)` is the call that undoes a result nobody took (its caller left while it ran).
Case fields keep the proto's numbers (`PrefillCase`, `PartialCase`, `LoadCase`, checked equal to
the proto's in the tests) so the core can judge them without importing protobuf.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import msgspec

from replica.engine.types import (
    BatchId,
    BatchSpec,
    CachedBatchInfo,
    DecodeInput,
    EngineInfo,
    HealthState,
    ImmigratedBatch,
    RequestId,
    StepResult,
    WarmupSpec,
)
from replica.links import PeerLink
from replica.zigzag.outcome import Relayed, ZagOutcome


class Lane(enum.Enum):
    """Where a call runs in the replica."""

    ENGINE = "engine"  # one work item on the engine thread
    SERVICE = "service"  # a thread of its own (waits for peers, or for a long engine item)


class PrefillCase(enum.IntFlag):
    """PrefillV2's `forward_case` bits (values of the proto's PrefillCase)."""

    NORMAL = 0
    MIGRATE = 1
    MIGRATE_PROGRESSIVE = 2
    NAIVE_PP = 4
    IMMIGRATE = 8


class PartialCase(enum.IntEnum):
    """Which half a partial migration moves (values of the proto's PartialCase)."""

    UNSPECIFIED = 0
    FIRST = 1
    SECOND = 2


class LoadCase(enum.IntEnum):
    """Where LoadParams reads the weights from (values of the proto's LoadParamCase)."""

    HOST_MEM = 0
    DISK = 1


class PipeStart(enum.Enum):
    """Where a relayed prefill resumes (the `start_layer` oneof of PipeParaInfo)."""

    EMBEDDING = "embedding_layer"
    LAYER = "tfm_layer"
    HEAD = "lm_head"


class BroadcastKind(enum.Enum):
    """The three weight broadcasts."""

    RDMA = "RdmaBroadcast"  # chain multicast in the background (WaitRdmaDone joins)
    NVL = "NvlBroadcast"  # chain multicast, blocking
    TANZ = "TanzBroadcast"  # multi-source lanes + ring all-gather, blocking


# ------------------------------------------------------------------------------------ replies
class ReplicaInfo(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Info: the engine's facts and this replica's place in the rank table."""

    engine: EngineInfo
    rank: int
    tp_size: int
    fabric: str = ""  # the fabric kind this replica moves KV and weights on ("" before it has one)
    weights_model: str = ""  # the model its weight buffer holds or last held ("": unknown)
    host_copies: tuple[tuple[str, int], ...] = ()  # (model, bytes) of its host-memory copies
    instance: str = ""  # a random id of this process, new at each start


class Discovery(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """ServiceDiscovery: this replica's TP group URLs and the rank table as JSON."""

    urls: tuple[str, ...]
    ranks_json: str


# -------------------------------------------------------------------------------------- calls
class Call(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """Base of every call; `lane` and `reply` describe it to both ends."""

    lane: ClassVar[Lane] = Lane.SERVICE
    reply: ClassVar[Any] = None

    def orphan(self, reply: Any) -> Call | None:
        """The call that undoes `reply` when nobody took it (None: nothing to undo)."""
        del reply
        return None


class Decode(Call, frozen=True):
    """DecodeV2 / Decode: append the tokens, merge the batches into the first, one decode step."""

    lane = Lane.ENGINE
    reply = StepResult
    inputs: tuple[DecodeInput, ...]


class Prefill(Call, frozen=True):
    """Prefill / PrefillV2 NORMAL: prefill a new batch (a first chunk of it) and cache it."""

    lane = Lane.ENGINE
    reply = StepResult
    batch: BatchSpec
    chunk_tokens: int = 0

    def orphan(self, reply: Any) -> Call | None:
        """A prefill whose caller left cached a batch nobody will decode: clear it."""
        batch = reply.batch if isinstance(reply, StepResult) else None
        return None if batch is None else Clear(batch.id)


class PrefillChunk(Call, frozen=True):
    """PrefillChunk: the next chunk of a prefilling batch; its first tokens once it is computed."""

    lane = Lane.ENGINE
    reply = StepResult
    batch_id: BatchId
    chunk_tokens: int

    def orphan(self, reply: Any) -> Call | None:
        """A chunk whose caller left: the batch stays cached for nobody; clear it."""
        batch = reply.batch if isinstance(reply, StepResult) else None
        return None if batch is None else Clear(batch.id)


class Filter(Call, frozen=True):
    """FilterBatch: keep the listed requests, free the pages of the rest."""

    lane = Lane.ENGINE
    reply = CachedBatchInfo
    batch_id: BatchId
    keep: tuple[RequestId, ...]


class Clear(Call, frozen=True):
    """ClearCache: free one batch's pages (every batch's with None)."""

    lane = Lane.ENGINE
    batch_id: BatchId | None = None


class Info(Call, frozen=True):
    """Info: read beside the engine thread (a long prefill must not look like a dead replica)."""

    reply = ReplicaInfo


class Warmup(Call, frozen=True):
    """Warmup: the largest prefill the limits allow, the KV cache sized from what is left."""

    lane = Lane.ENGINE
    reply = int | None
    spec: WarmupSpec


class Health(Call, frozen=True):
    """Health (generate.v2's): serving / loading / inactive."""

    reply = HealthState


class Discover(Call, frozen=True):
    """ServiceDiscovery."""

    reply = Discovery


class ConnectPeers(Call, frozen=True):
    """ConnectPeers: set up the fabric's connections with `peers` (`replica.links`)."""

    reply = tuple[PeerLink, ...]
    peers: tuple[int, ...]


class Migrate(Call, frozen=True):
    """Migrate (sender): every layer of the batch's KV to `dst`, then free it here."""

    reply = CachedBatchInfo
    batch: BatchSpec
    src: tuple[int, ...]
    dst: tuple[int, ...]


class Immigrate(Call, frozen=True):
    """Immigrate (receiver): admit, receive every layer from `src`, return it decode-ready."""

    reply = ImmigratedBatch
    batch: BatchSpec
    src: tuple[int, ...]
    dst: tuple[int, ...]


class MigratePartial(Call, frozen=True):
    """MigratePartial (sender of one half)."""

    reply = CachedBatchInfo
    batch: BatchSpec
    half: int  # PartialCase
    num_layer: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


class ImmigratePartial(Call, frozen=True):
    """ImmigratePartial (receiver of one half)."""

    reply = ImmigratedBatch
    batch: BatchSpec
    half: int  # PartialCase
    num_layer: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


class MigratingPrefill(Call, frozen=True):
    """PrefillV2 MIGRATE / MIGRATE_PROGRESSIVE: prefill here, its KV to `pipe_peer`."""

    reply = StepResult
    batch: BatchSpec
    forward_case: int  # PrefillCase bits
    pipe_peer: tuple[int, ...]


class PipelinedPrefill(Call, frozen=True):
    """PrefillV2 NAIVE_PP|IMMIGRATE: finish a relayed batch from the layer `start` names."""

    reply = StepResult
    batch: BatchSpec
    forward_case: int  # PrefillCase bits
    start: PipeStart | None  # unset pp_info: from the embedding
    start_layer: int  # the oneof's value for PipeStart.LAYER
    pipe_peer: tuple[int, ...]


class ZagPrefill(Call, frozen=True):
    """ZagPrefill: a layer-level prefill, in `seq` order, as the weights land."""

    reply = ZagOutcome
    batch: BatchSpec
    forward_case: int  # PrefillCase bits
    seq: int


class Relay(Call, frozen=True):
    """Relay: hand one queued layer-level prefill to replica `rank`."""

    reply = Relayed | None
    rank: int
    relax_not_head: bool


class LoadParams(Call, frozen=True):
    """LoadParams: fill the weight buffer from disk or host memory."""

    case: int  # LoadCase
    model_name: str
    model_path: str | None


class SendParams(Call, frozen=True):
    """SendParams: p2p weights to `dst`, in the background."""

    dst: int
    model_name: str = ""  # the model sent: a sender holding another refuses ("": not checked)
    host_copy_model: str = ""  # send this model's host-memory copy instead of the buffer
    share: int = 0  # send only share `share` of `shares` of the regions (replica/params/shares.py)
    shares: int = 0  # 0: every region


class RecvParams(Call, frozen=True):
    """RecvParams: p2p weights from `src`, in the background."""

    src: int
    model_name: str = ""  # the model received, recorded as what the buffer holds ("": unknown)
    more_srcs: tuple[int, ...] = ()  # further sources at once: share i from source i (src first)


class Broadcast(Call, frozen=True):
    """RdmaBroadcast / NvlBroadcast / TanzBroadcast over the flattened rank lists."""

    kind: BroadcastKind
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    model_name: str = ""  # the model broadcast: checked on sources, recorded on receivers


class WaitRdmaDone(Call, frozen=True):
    """WaitRdmaDone: join the background parameter operation."""


class ResetStatus(Call, frozen=True):
    """ResetStatus: mark the weights unloaded."""


class SetStatusReady(Call, frozen=True):
    """SetStatusReady: mark every region loaded (a test backdoor behind a flag)."""


CALLS: tuple[type[Call], ...] = (
    Decode, Prefill, PrefillChunk, Filter, Clear, Info, Warmup, Health, Discover, Migrate, Immigrate,
    MigratePartial, ImmigratePartial, MigratingPrefill, PipelinedPrefill, ZagPrefill, Relay,
    LoadParams, SendParams, RecvParams, Broadcast, WaitRdmaDone, ResetStatus, SetStatusReady, ConnectPeers,
)  # fmt: skip
AnyCall = (
    Decode | Prefill | PrefillChunk | Filter | Clear | Info | Warmup | Health | Discover | Migrate | Immigrate
    | MigratePartial | ImmigratePartial | MigratingPrefill | PipelinedPrefill | ZagPrefill | Relay
    | LoadParams | SendParams | RecvParams | Broadcast | WaitRdmaDone | ResetStatus | SetStatusReady
    | ConnectPeers
)  # fmt: skip
"""The union a replica decodes (every concrete call; `CALLS` lists the same classes)."""
