"""The replica's typed errors: one class per gRPC status a caller can get.

Everything inside the replica raises these (or lets a transfer error through, which the edge maps
to UNAVAILABLE / DEADLINE_EXCEEDED); the edge's `interceptor.guard` turns them into precise statuses.
Nothing here imports grpc: the mapping lives at the edge.

An error caused by another replica (a transfer peer that went away or did not answer) also says so
in the trailing metadata, `x-pdcluster-cause: peer`: UNAVAILABLE alone cannot tell a caller whether
the replica it called is gone or the replica answered that its peer is.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """The status a replica error maps to (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INTERNAL = "INTERNAL"


CAUSE_KEY = "x-pdcluster-cause"  # trailing metadata key; value PEER_CAUSE or absent
PEER_CAUSE = "peer"


class ReplicaError(Exception):
    """Base of every error the replica reports to its caller."""

    status: Status = Status.INTERNAL
    cause: str | None = None  # PEER_CAUSE: another replica failed, this one is fine


class InvalidArgument(ReplicaError):
    """Malformed request, token out of vocabulary, bad sampling values, lists of the wrong length."""

    status = Status.INVALID_ARGUMENT


class NotFound(ReplicaError):
    """Unknown batch id (or request id inside a batch)."""

    status = Status.NOT_FOUND


class AlreadyExists(ReplicaError):
    """Batch id already cached."""

    status = Status.ALREADY_EXISTS


class ResourceExhausted(ReplicaError):
    """Not enough free KV pages, or a prompt over the limits."""

    status = Status.RESOURCE_EXHAUSTED


class FailedPrecondition(ReplicaError):
    """Weights not loaded, wrong role, or an operation out of order."""

    status = Status.FAILED_PRECONDITION


class PeerTimeout(ReplicaError):
    """A peer did not answer in time during a transfer."""

    status = Status.DEADLINE_EXCEEDED
    cause = PEER_CAUSE


class PeerUnavailable(ReplicaError):
    """A peer went away or refused the connection during a transfer."""

    status = Status.UNAVAILABLE
    cause = PEER_CAUSE


class PermissionDenied(ReplicaError):
    """Admin call without the token, or a load path outside the model root."""

    status = Status.PERMISSION_DENIED


class DeadlineExceeded(ReplicaError):
    """The call's own deadline passed before the engine finished its work (nothing was kept)."""

    status = Status.DEADLINE_EXCEEDED


class ShuttingDown(ReplicaError):
    """The replica is stopping (or its engine thread is gone) and takes no more work."""

    status = Status.UNAVAILABLE
