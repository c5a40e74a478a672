"""The RDMA fabric's hardware-free logic: tickets, write planning, queue-pair attributes, windows,
completion-status mapping, device choice, and the `VerbsBackend` protocol the fabric drives.

Protocol (receiver-driven, like the reference's "pickle"): for each posted receive the receiver
SENDs a *ticket* (sequence number + its scatter list with remote keys) to the sender; the sender
matches tickets to its posted sends in order, RDMA-WRITEs its gather list into the ticket's
segments and finishes with a zero-length WRITE_WITH_IMM carrying the sequence number, which
completes the receive on the other side. Queue-pair info travels through the caller's rendezvous.
"""

from __future__ import annotations

import ctypes
import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from transfer.errors import PeerGone, PeerTimeout, TransferError

TICKET_HEADER = struct.Struct("!QI")
TICKET_ENTRY = struct.Struct("!QII")
SLOT_BYTES = 8192  # one control slot; a ticket carries up to (8192 - 12) / 16 = 511 segments
MAX_TICKET_SEGMENTS = (SLOT_BYTES - TICKET_HEADER.size) // TICKET_ENTRY.size
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class RemoteSegment:
    """A piece of the receiver's registered memory."""

    addr: int
    length: int
    rkey: int


@dataclass(frozen=True)
class LocalSegment:
    """A piece of this rank's registered memory."""

    addr: int
    length: int
    lkey: int


@dataclass(frozen=True)
class Ticket:
    """A receiver's posted receive, as announced to the sender."""

    seq: int
    segments: tuple[RemoteSegment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)

    def encode(self) -> bytes:
        if len(self.segments) > MAX_TICKET_SEGMENTS:
            raise ValueError(f"a receive may scatter to at most {MAX_TICKET_SEGMENTS} segments")
        entries = b"".join(TICKET_ENTRY.pack(s.addr, s.length, s.rkey) for s in self.segments)
        return TICKET_HEADER.pack(self.seq, len(self.segments)) + entries

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Ticket:
        seq, count = TICKET_HEADER.unpack_from(data, 0)
        segments = tuple(
            RemoteSegment(*TICKET_ENTRY.unpack_from(data, TICKET_HEADER.size + i * TICKET_ENTRY.size))
            for i in range(count)
        )
        return cls(seq, segments)


@dataclass(frozen=True)
class WritePlan:
    """One RDMA WRITE: local gather list into one contiguous remote range."""

    sges: tuple[LocalSegment, ...]
    remote_addr: int
    rkey: int

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.sges)


def plan_writes(
    local: Sequence[LocalSegment], remote: Sequence[RemoteSegment], max_sge: int, max_bytes: int
) -> list[WritePlan]:
    """WRITEs moving `local` (in order) into `remote` (in order): each ≤ max_sge SGEs, ≤ max_bytes."""
    if sum(s.length for s in local) != sum(s.length for s in remote):
        raise TransferError("the send and the receive have different sizes")
    writes: list[WritePlan] = []
    li, loff = 0, 0
    for target in remote:
        done = 0
        while done < target.length:
            sges: list[LocalSegment] = []
            size = 0
            while done + size < target.length and len(sges) < max_sge and size < max_bytes:
                piece = min(local[li].length - loff, target.length - done - size, max_bytes - size)
                sges.append(LocalSegment(local[li].addr + loff, piece, local[li].lkey))
                size += piece
                loff += piece
                if loff == local[li].length:
                    li, loff = li + 1, 0
            writes.append(WritePlan(tuple(sges), target.addr + done, target.rkey))
            done += size
    return writes


@dataclass(frozen=True)
class QpInfo:
    """What a peer needs to connect to one of our queue pairs (exchanged via rendezvous)."""

    qpn: int
    psn: int
    lid: int
    gid: str
    mtu: int
    layout: str
    version: int = PROTOCOL_VERSION

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> QpInfo:
        return cls(**json.loads(data))


def rtr_attributes(remote: QpInfo, port: int, gid_index: int, mtu: int) -> dict[str, Any]:
    """QPAttr fields to move a reliable-connected QP to Ready-To-Receive towards `remote`."""
    return {
        "path_mtu": min(mtu, remote.mtu),
        "dest_qp_num": remote.qpn,
        "rq_psn": remote.psn,
        "max_dest_rd_atomic": 1,
        "min_rnr_timer": 12,  # 0.64 ms
        "ah_port_num": port,
        "ah_dlid": remote.lid,
        "ah_is_global": bool(remote.gid and remote.gid != "::"),
        "ah_dgid": remote.gid,
        "ah_sgid_index": gid_index,
        "ah_hop_limit": 1,
    }


def rts_attributes(psn: int) -> dict[str, Any]:
    """QPAttr fields to move a QP to Ready-To-Send."""
    return {
        "sq_psn": psn,
        "timeout": 14,  # 4.096 µs · 2^14 ≈ 67 ms per retry
        "retry_cnt": 7,
        "rnr_retry": 7,  # infinite: a receiver briefly out of posted receives is not an error
        "max_rd_atomic": 1,
    }


class WcStatus(enum.IntEnum):
    """The ibv_wc_status values the fabric distinguishes."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13


def map_wc_status(status: int, what: str) -> TransferError:
    """The transfer error for a failed work completion."""
    if status in (WcStatus.RETRY_EXC_ERR, WcStatus.REM_OP_ERR):
        return PeerGone(f"{what}: peer unreachable (completion status {status})")
    if status == WcStatus.RNR_RETRY_EXC_ERR:
        return PeerTimeout(f"{what}: peer posted no receive in time")
    if status == WcStatus.WR_FLUSH_ERR:
        return PeerGone(f"{what}: queue pair flushed (aborted)")
    return TransferError(f"{what}: work completion failed with status {status}")


class SendWindow:
    """Bounds outstanding send-queue work requests (the QP's max_send_wr)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("window capacity must be positive")
        self.capacity = capacity
        self.outstanding = 0

    def room(self) -> int:
        return self.capacity - self.outstanding

    def take(self, n: int) -> None:
        if n > self.room():
            raise ValueError(f"{n} work requests do not fit in the window ({self.room()} free)")
        self.outstanding += n

    def release(self, n: int) -> None:
        self.outstanding = max(0, self.outstanding - n)


def pick_device(devices: Sequence[Any] | None, name: str) -> Any:
    """The device named `name` (or the first); a clear error when there is none."""
    if not devices:
        raise TransferError("no RDMA device found (ibv_get_device_list returned none)")
    for device in devices:
        device_name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        if not name or device_name == name:
            return device
    raise TransferError(f"RDMA device {name!r} not found")


def host_address(obj: object) -> tuple[int, int]:
    """(address, nbytes) of host memory with the buffer protocol, or device memory (GPUDirect)."""
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        from transfer.nccl.logic import cuda_pointer

        return cuda_pointer(obj)
    view = memoryview(obj).cast("B")  # type: ignore[arg-type]
    if view.readonly:
        raise ValueError("RDMA buffers must be writable")
    return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes


class Completion(Protocol):
    """A polled work completion."""

    wr_id: int
    status: int
    imm: int | None  # immediate data of a received WRITE_WITH_IMM (None for a plain SEND)
    byte_len: int


class VerbsBackend(Protocol):
    """The slice of libibverbs the fabric drives (pyverbs in production, a double in tests)."""

    max_sge: int

    def register(self, addr: int, nbytes: int) -> tuple[int, int]: ...  # (lkey, rkey)
    def deregister(self, lkey: int) -> None: ...
    def create_qp(self) -> Any: ...
    def local_info(self, qp: Any, layout: str) -> QpInfo: ...
    def connect(self, qp: Any, remote: QpInfo) -> None: ...
    def post_recv(self, qp: Any, wr_id: int, sges: Sequence[LocalSegment]) -> None: ...
    def post_send(self, qp: Any, wr_id: int, sges: Sequence[LocalSegment]) -> None: ...
    def post_write(self, qp: Any, wr_id: int, write: WritePlan, imm: int | None, signaled: bool) -> None: ...
    def poll(self, max_entries: int) -> Sequence[Completion]: ...
    def error_qp(self, qp: Any) -> None: ...
    def close(self) -> None: ...
