"""Typed failures of replica calls (the client edge maps gRPC statuses onto them).

The loops decide by type: a dead replica (`ReplicaUnavailable`) re-runs its requests elsewhere, a
replica that answered that its transfer peer failed (`PeerFailed`) is alive and the batch runs
again, a replica out of KV pages (`out_of_pages`) gets the batch again once it freed them, anything
else fails only that batch.
"""

from __future__ import annotations


class ReplicaCallError(Exception):
    """A replica call failed; `code` is the gRPC status name."""

    def __init__(self, address: str, method: str, code: str, details: str) -> None:
        super().__init__(f"replica {address} {method}: {code}: {details}")
        self.address = address
        self.method = method
        self.code = code
        self.details = details


class ReplicaUnavailable(ReplicaCallError):
    """The replica cannot be reached: treat it as dead."""


class PeerFailed(ReplicaCallError):
    """The replica answered UNAVAILABLE for another replica (a transfer peer went away or refused):
    the replica called is alive; the batch can run again."""


class ReplicaTimeout(ReplicaCallError):
    """The call's deadline passed."""


class ReplicaUnimplemented(ReplicaCallError):
    """The replica does not implement this RPC (yet)."""


class ReplicaRejected(ReplicaCallError):
    """The replica refused the call (bad arguments, no pages, wrong state...)."""


class ReplicaInternal(ReplicaCallError):
    """The replica failed internally."""


def out_of_pages(exc: ReplicaCallError) -> bool:
    """The replica refused for want of free KV pages (RESOURCE_EXHAUSTED).

    The router admits requests against the replicas' limits before queueing, so the other reason
    for that code (a prompt over the limits) does not reach a replica from the router.
    """
    return isinstance(exc, ReplicaRejected) and exc.code == "RESOURCE_EXHAUSTED"
