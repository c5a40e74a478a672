"""Moving a layer-level prefill's activation between replicas on the ACTIVATION stream.

The new replica sends the hidden states after k layers (tokens × hidden, model dtype) to the old
replica, which posts the matching receive when its PrefillV2 NAIVE_PP|IMMIGRATE arrives. Messages
of one (peer, stream) pair match in posting order, so relays and PrefillV2 calls pair up in order.
Each activation is registered under its own name for the time of its transfer (fabrics move only
registered memory) and unregistered when the transfer ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

from replica.params.transfer import replica_error
from transfer.core import Deadline, Handle, Stream
from transfer.errors import TransferError
from transfer.fabric import Fabric

log = logging.getLogger(__name__)

_names = itertools.count()


class ActivationLink:
    """Sends and receives activations over this replica's fabric."""

    def __init__(self, fabric: Fabric, timeout: float) -> None:
        self.fabric = fabric
        self.timeout = timeout
        self._lock = threading.Lock()
        self._in_flight: dict[str, Any] = {}  # keeps each sent buffer alive until done

    def send(self, peer: int, tensor: Any) -> Handle:
        """Post the send of `tensor` (a buffer of its own: `Runner.sendable`) to `peer`; returns at
        once (failures are logged)."""
        name = f"activation-out:{next(_names)}"
        nbytes = self.fabric.register(name, tensor)
        with self._lock:
            self._in_flight[name] = tensor
        handle = self.fabric.send(peer, name, [(0, nbytes)], Stream.ACTIVATION, Deadline.after(self.timeout))
        handle.add_done_callback(lambda h: self._sent(name, peer, h))
        return handle

    def _sent(self, name: str, peer: int, handle: Handle) -> None:
        self.fabric.unregister(name)
        with self._lock:
            self._in_flight.pop(name, None)
        if handle.error is not None:
            log.warning("activation to rank %d failed: %s", peer, handle.error)

    def receive(self, peer: int, tensor: Any, timeout: float) -> Any:
        """Receive one activation from `peer` into `tensor` (`Runner.empty_activation`) and return it
        (blocks; deadline = min(timeout, transfer))."""
        name = f"activation-in:{next(_names)}"
        nbytes = self.fabric.register(name, tensor)
        deadline = Deadline.after(min(timeout, self.timeout))
        try:
            self.fabric.recv(peer, name, [(0, nbytes)], Stream.ACTIVATION, deadline).wait(deadline)
        except TransferError as exc:
            raise replica_error(exc, f"receiving the activation from rank {peer}") from exc
        finally:
            self.fabric.unregister(name)
        return tensor
