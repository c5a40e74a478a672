"""The one exception hierarchy of the transfer layer.

The replica maps them to gRPC statuses: `PeerTimeout` → DEADLINE_EXCEEDED, `PeerGone` → UNAVAILABLE,
`LayoutMismatch` → FAILED_PRECONDITION, any other `TransferError` → INTERNAL.
"""

from __future__ import annotations


class TransferError(Exception):
    """A transfer failed; the buffers involved stay registered and a retry may succeed."""


class PeerTimeout(TransferError):
    """The deadline passed before the peer finished its part (slow, stalled or not started)."""


class PeerGone(TransferError):
    """The connection to a peer was lost: it died, closed, or aborted the transfer."""


class LayoutMismatch(TransferError):
    """The two sides of a connection disagree on the protocol version or the buffer layout."""


class FabricClosed(TransferError):
    """The fabric was closed while the operation was pending, or an operation was posted after close."""


class FabricUnavailable(TransferError):
    """The chosen fabric cannot start here: its module, device, NIC or rendezvous store is missing."""
