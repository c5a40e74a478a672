"""The fake replica's weights: the rules of `replica/params` without bytes (its README, "Decisions").

- One parameter operation at a time (`op` names it): a background one (SendParams, RecvParams,
  RdmaBroadcast) holds the guard until WaitRdmaDone joins it, a blocking one (LoadParams,
  TanzBroadcast, ResetStatus) while it runs; another meanwhile → FAILED_PRECONDITION.
- A fill (receive, load) refuses a complete buffer; a sender needs one.
- ResetStatus of a complete buffer keeps a host-memory copy; LOAD_FROM_HOST_MEM needs one.
- WaitRdmaDone with no background operation → FAILED_PRECONDITION; it raises the operation's error.

The weights are all there or not at all (`loaded`): a transfer lands at its end, after `delay`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from tests.helpers.fake_errors import Refused


class FakeWeights:
    """Readiness, the one-operation guard and the host-memory copy of one fake replica."""

    def __init__(self, loaded: bool) -> None:
        self.loaded = loaded
        self.host_copy = False
        self.op = ""  # the operation holding the guard ("" = none)
        self.delay = 0.0  # seconds a transfer or load takes
        self.fail: grpc.StatusCode | None = None  # the next transfer or load fails so (nothing lands)
        self._background: asyncio.Task[None] | None = None

    def _take(self, name: str) -> None:
        if self.op:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{name}: another parameter operation ({self.op}) is in flight")
        self.op = name

    def _check(self, receives: bool, sends: bool, name: str) -> None:
        if receives and self.loaded:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{name}: the weights are complete (ResetStatus first)")
        if sends and not self.loaded:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{name}: a source needs complete weights")

    def start_background(self, name: str, receives: bool, sends: bool) -> None:
        """Send/Recv/RdmaBroadcast: checked and started now, joined by `join`."""
        self._check(receives, sends, name)
        self._take(name)
        self._background = asyncio.get_running_loop().create_task(self._land(receives))

    async def run_blocking(self, name: str, receives: bool, sends: bool = False) -> None:
        """A transfer or load that the call waits for (TanzBroadcast, LoadParams)."""
        self._check(receives, sends, name)
        self._take(name)
        try:
            await self._land(receives)
        finally:
            self.op = ""

    async def _land(self, receives: bool) -> None:
        await asyncio.sleep(self.delay)  # the transfer's time (a test sets it to land a fault inside)
        code, self.fail = self.fail, None
        if code is not None:
            raise Refused(code, "injected transfer failure")
        if receives:
            self.loaded = True

    async def join(self) -> None:
        """WaitRdmaDone: wait for the background operation; the guard is free afterwards."""
        task = self._background
        if task is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "WaitRdmaDone: no background operation")
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._background, self.op = None, ""

    async def load_from_host(self) -> None:
        """LoadParams(LOAD_FROM_HOST_MEM)."""
        await self._blocking_fill("LoadParams(host)", lambda: self.host_copy,
                                  "host cache miss: no host-memory copy")

    async def load_from_disk(self, name: str) -> None:
        """LoadParams(LOAD_FROM_DISK) of a checkpoint under the model root (any name here)."""
        if not name:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "LOAD_FROM_DISK needs model_path or model_name")
        await self._blocking_fill("LoadParams(disk)", lambda: True, "")

    async def _blocking_fill(self, name: str, possible: Callable[[], bool], why_not: str) -> None:
        self._check(True, False, name)
        if not possible():
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{name}: {why_not}")
        await self.run_blocking(name, receives=True)

    async def reset(self) -> None:
        """ResetStatus: unloaded; a complete buffer stays in host memory."""
        self._take("ResetStatus")
        self.host_copy = self.host_copy or self.loaded
        self.loaded = False
        self.op = ""

