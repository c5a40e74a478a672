"""`ParamReadiness`: which weight regions of this replica are in place (pure Python, thread-safe).

Readiness is three facts, as in the contract: the embedding is ready, the number of transformer
layers loaded (0..L), the head (final norm + lm_head) is ready. Regions may land in any order (Tanz
completes them out of order), so "layers loaded" counts the contiguous prefix 0..n-1 of landed
layers: layer i is usable exactly when `i < layers_loaded`, which is what the forward waits on.

Invariant: `0 <= layers_loaded <= L`, and the replica is *loaded* (embed, all L layers and head)
or *unloaded* (anything less). `mark_all` / `reset` jump between the two; `mark` rises one region
at a time and wakes every waiter and listener.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from replica.errors import DeadlineExceeded, FailedPrecondition
from replica.model.layout import RegionKind

Listener = Callable[["Readiness"], None]


@dataclass(frozen=True)
class Readiness:
    """A snapshot of the parameter readiness."""

    embed: bool
    layers: int
    head: bool
    num_layers: int

    @property
    def complete(self) -> bool:
        """Everything loaded: the replica can serve a full forward."""
        return self.embed and self.layers == self.num_layers and self.head

    @property
    def empty(self) -> bool:
        """Nothing loaded at all."""
        return not self.embed and self.layers == 0 and not self.head


class ParamReadiness:
    """Per-region readiness of one weight buffer with waits (deadlines) and listeners."""

    def __init__(self, num_layers: int, loaded: bool = True) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._listeners: list[Listener] = []
        self._embed = loaded
        self._head = loaded
        self._layers: set[int] = set(range(num_layers)) if loaded else set()
        self._prefix = num_layers if loaded else 0
        self._resets = 0

    # ------------------------------------------------------------------------------ reading
    def snapshot(self) -> Readiness:
        """The three facts at this instant."""
        with self._cond:
            return Readiness(self._embed, self._prefix, self._head, self.num_layers)

    @property
    def complete(self) -> bool:
        """Whether every region is in place."""
        return self.snapshot().complete

    def require_complete(self, what: str) -> None:
        """Raise FAILED_PRECONDITION unless every region is in place (never waits)."""
        state = self.snapshot()
        if not state.complete:
            raise FailedPrecondition(
                f"{what} needs every weight loaded; this replica has embed={state.embed}, "
                f"{state.layers}/{state.num_layers} layers, head={state.head}"
            )

    def wait_for(self, predicate: Callable[[Readiness], bool], timeout: float | None, what: str) -> None:
        """Block until `predicate(snapshot)` holds; DEADLINE_EXCEEDED after `timeout` seconds."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: predicate(Readiness(self._embed, self._prefix, self._head, self.num_layers)),
                timeout,
            )
        if not ok:
            raise DeadlineExceeded(f"{what}: weights did not arrive within {timeout} s")

    def wait_layer(self, index: int, timeout: float | None) -> None:
        """Block until layer `index` is usable (with the embedding)."""
        self.wait_for(lambda r: r.embed and r.layers > index, timeout, f"layer {index}")

    # ------------------------------------------------------------------------------ writing
    def mark(self, kind: RegionKind, index: int = 0) -> None:
        """One region landed completely (safe from any thread)."""
        with self._cond:
            if kind is RegionKind.EMBED:
                self._embed = True
            elif kind is RegionKind.HEAD:
                self._head = True
            else:
                if not 0 <= index < self.num_layers:
                    raise ValueError(f"layer {index} outside 0..{self.num_layers - 1}")
                self._layers.add(index)
                while self._prefix in self._layers:
                    self._prefix += 1
        self._changed()

    def mark_all(self) -> None:
        """Every region is in place (after a blocking load, or SetStatusReady)."""
        with self._cond:
            self._embed = self._head = True
            self._layers = set(range(self.num_layers))
            self._prefix = self.num_layers
        self._changed()

    def relayout(self, num_layers: int) -> None:
        """Nothing is in place, and the buffer now holds a model of `num_layers` layers (a switch)."""
        with self._cond:
            self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        """Nothing is in place any more (ResetStatus)."""
        with self._cond:
            self._embed = self._head = False
            self._layers = set()
            self._prefix = 0
            self._resets += 1
        self._changed()

    @property
    def resets(self) -> int:
        """How many times the weights were unloaded (K/V computed before a reset may not match after)."""
        with self._cond:
            return self._resets

    def subscribe(self, listener: Listener) -> None:
        """Call `listener(snapshot)` after every change (on the changing thread: keep it quick)."""
        with self._cond:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling `listener` (a model switch drops the packs that followed the old model)."""
        with self._cond:
            self._listeners = [x for x in self._listeners if x is not listener]

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()
            state = Readiness(self._embed, self._prefix, self._head, self.num_layers)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(state)
