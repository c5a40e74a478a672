"""`SplitFabric`: control in host memory over a host fabric (tcp), bulk device memory over a device
fabric (nccl, rdma) — the one fabric of a replica whose KV cache and weights are on a GPU.

```
 register(name, obj) ── device memory? ─ yes ─► bulk     KV, weights, activations  (nccl / rdma)
                                       └─ no ──► control  migration headers, acknowledgements,
                                                          confirmations (negative streams)  (tcp)
 send / recv(name) go where `name` is registered;  connect · abort · refresh · close go to both
```
Messages of one (peer, stream) keep their order within each fabric; a migration header (control)
and the KV pages after it (bulk) are on different fabrics, which is safe because the receiver
reads the header before it posts the pages' receives. Both ends must route a message the same
way: a buffer in host memory on one side and in device memory on the other would wait on different
fabrics. So the control fabric's layouts name the bulk fabric (`<descriptor>|bulk=<kind>`, set for
the named streams at creation): a peer on another fabric, or whose KV is in host memory, fails the
handshake with `LayoutMismatch` instead of waiting for a message that goes elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from transfer.buffers import device_type
from transfer.core import Deadline, Handle, Segments, Stream, all_of
from transfer.errors import TransferError
from transfer.fabric import Fabric


def on_device(obj: object) -> bool:
    """Whether `obj` is device memory (a CUDA torch tensor, a cupy array): the bulk fabric's."""
    return device_type(obj) != "cpu" or hasattr(obj, "__cuda_array_interface__")


class SplitFabric(Fabric):
    """One fabric made of `control` (host buffers) and `bulk` (device buffers, `is_bulk`)."""

    def __init__(self, control: Fabric, bulk: Fabric, bulk_kind: str,
                 is_bulk: Callable[[object], bool] = on_device) -> None:
        if control.rank != bulk.rank or control.table != bulk.table:
            raise ValueError("the control and bulk fabrics must serve the same rank of the same table")
        super().__init__(control.table, control.rank)
        self.control, self.bulk, self.bulk_kind, self._is_bulk = control, bulk, bulk_kind, is_bulk
        self._routes: dict[str, Fabric] = {}
        self._lock = threading.Lock()
        for stream in Stream:
            self.control.set_layout(stream, self._tagged(""))

    def _tagged(self, descriptor: str) -> str:
        return f"{descriptor}|bulk={self.bulk_kind}"

    def _route(self, name: str) -> Fabric:
        with self._lock:
            if name not in self._routes:
                raise KeyError(f"no buffer registered as {name!r}")
            return self._routes[name]

    def register(self, name: str, obj: object) -> int:
        target = self.bulk if self._is_bulk(obj) else self.control
        size = target.register(name, obj)
        with self._lock:
            previous, self._routes[name] = self._routes.get(name), target
        if previous is not None and previous is not target:
            previous.unregister(name)
        return size

    def unregister(self, name: str) -> None:
        with self._lock:
            target = self._routes.pop(name, None)
        if target is not None:
            target.unregister(name)

    def set_layout(self, stream: int, descriptor: str) -> None:
        self.bulk.set_layout(stream, descriptor)
        self.control.set_layout(stream, self._tagged(descriptor))

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._route(name).send(peer, name, segments, stream, deadline)

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._route(name).recv(peer, name, segments, stream, deadline)

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        if stream < 0:  # control streams carry confirmations only: host memory
            return self.control.connect(peer, stream, deadline)
        both = [self.control.connect(peer, stream, deadline), self.bulk.connect(peer, stream, deadline)]
        return all_of(both, f"rank {self.rank} connect to {peer} stream {stream}")

    def warm(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        if stream < 0:
            return self.control.warm(peer, stream, deadline)
        both = [self.control.warm(peer, stream, deadline), self.bulk.warm(peer, stream, deadline)]
        return all_of(both, f"rank {self.rank} warm {peer} stream {stream}")

    def abort(self, peer: int, stream: int, reason: str) -> None:
        self.control.abort(peer, stream, reason)
        self.bulk.abort(peer, stream, reason)

    def refresh(self, peer: int, stream: int) -> None:
        self.control.refresh(peer, stream)
        self.bulk.refresh(peer, stream)

    def withdraw(self, peer: int, stream: int, handle: Handle, error: TransferError) -> bool:
        # a fabric answers False for a handle it does not hold, so asking both is safe
        return self.control.withdraw(peer, stream, handle, error) or self.bulk.withdraw(
            peer, stream, handle, error)

    def close(self) -> None:
        try:
            self.bulk.close()
        finally:
            self.control.close()
