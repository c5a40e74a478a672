"""The RDMA fabric's hardware-free logic: tickets, write plans, QP attributes, windows, errors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from transfer.errors import PeerGone, PeerTimeout, TransferError
from transfer.rdma.channel import Kind, unpack_wr_id, wr_id
from transfer.rdma.logic import (
    MAX_TICKET_SEGMENTS,
    LocalSegment,
    QpInfo,
    RemoteSegment,
    SendWindow,
    Ticket,
    WcStatus,
    host_address,
    map_wc_status,
    pick_device,
    plan_writes,
    rtr_attributes,
    rts_attributes,
)


def test_ticket_round_trip_and_limit() -> None:
    ticket = Ticket(2**40 + 3, (RemoteSegment(0x1000, 4096, 7), RemoteSegment(0x9000, 1, 7)))
    assert Ticket.decode(ticket.encode()) == ticket and ticket.nbytes == 4097
    too_many = Ticket(0, tuple(RemoteSegment(i, 1, 1) for i in range(MAX_TICKET_SEGMENTS + 1)))
    with pytest.raises(ValueError, match="at most"):
        too_many.encode()


def _bytes_moved(
    local: list[LocalSegment], remote: list[RemoteSegment], max_sge: int, max_bytes: int
) -> None:
    """Simulate the writes over flat memories and check every byte lands in its place."""
    source = np.arange(10_000, dtype=np.uint32).astype(np.uint8)
    target = np.zeros(20_000, np.uint8)
    writes = plan_writes(local, remote, max_sge, max_bytes)
    for write in writes:
        assert len(write.sges) <= max_sge and write.nbytes <= max_bytes
        data = np.concatenate([source[s.addr : s.addr + s.length] for s in write.sges])
        target[write.remote_addr : write.remote_addr + len(data)] = data
    expected = np.concatenate([source[s.addr : s.addr + s.length] for s in local])
    got = np.concatenate([target[r.addr : r.addr + r.length] for r in remote])
    assert np.array_equal(expected, got)


def test_write_plans_gather_and_scatter_exactly() -> None:
    local = [LocalSegment(0, 100, 1), LocalSegment(500, 7, 1), LocalSegment(1000, 300, 1)]
    remote = [RemoteSegment(15_000, 50, 2), RemoteSegment(2_000, 357, 2)]
    _bytes_moved(local, remote, max_sge=2, max_bytes=64)
    _bytes_moved(local, remote, max_sge=16, max_bytes=1 << 20)
    assert len(plan_writes(local, remote, 16, 1 << 20)) == 2  # one write per remote segment
    assert plan_writes([], [], 4, 100) == []
    with pytest.raises(TransferError, match="different sizes"):
        plan_writes(local, remote[:1], 4, 100)


def test_qp_attributes() -> None:
    remote = QpInfo(qpn=77, psn=123, lid=5, gid="fe80::1", mtu=3, layout="x")
    rtr = rtr_attributes(remote, port=1, gid_index=3, mtu=5)
    assert (rtr["dest_qp_num"], rtr["rq_psn"], rtr["path_mtu"], rtr["ah_dlid"]) == (77, 123, 3, 5)
    assert rtr["ah_is_global"] and rtr["ah_sgid_index"] == 3
    assert not rtr_attributes(QpInfo(1, 0, 9, "::", 5, ""), 1, 0, 5)["ah_is_global"]  # InfiniBand, no GRH
    rts = rts_attributes(psn=42)
    assert rts["sq_psn"] == 42 and rts["rnr_retry"] == 7
    assert QpInfo.from_bytes(remote.to_bytes()) == remote


def test_completion_status_mapping() -> None:
    assert isinstance(map_wc_status(WcStatus.RETRY_EXC_ERR, "x"), PeerGone)
    assert isinstance(map_wc_status(WcStatus.WR_FLUSH_ERR, "x"), PeerGone)
    assert isinstance(map_wc_status(WcStatus.RNR_RETRY_EXC_ERR, "x"), PeerTimeout)
    assert type(map_wc_status(WcStatus.LOC_PROT_ERR, "x")) is TransferError


def test_send_window() -> None:
    window = SendWindow(4)
    window.take(3)
    assert window.room() == 1
    with pytest.raises(ValueError):
        window.take(2)
    window.release(3)
    assert window.room() == 4
    with pytest.raises(ValueError):
        SendWindow(0)


@dataclass
class _Device:
    name: bytes


def test_device_choice_handles_no_device() -> None:
    with pytest.raises(TransferError, match="no RDMA device"):
        pick_device([], "")
    with pytest.raises(TransferError, match="no RDMA device"):
        pick_device(None, "")
    devices = [_Device(b"mlx5_0"), _Device(b"mlx5_1")]
    assert pick_device(devices, "").name == b"mlx5_0"
    assert pick_device(devices, "mlx5_1").name == b"mlx5_1"
    with pytest.raises(TransferError, match="not found"):
        pick_device(devices, "rxe0")


def test_wr_ids_and_addresses() -> None:
    assert unpack_wr_id(wr_id(5, 300, Kind.TICKET, 17)) == (5, 300 & 0xFF, Kind.TICKET, 17)
    buf = bytearray(64)
    addr, size = host_address(buf)
    assert size == 64 and addr > 0
    with pytest.raises(ValueError, match="writable"):
        host_address(b"read only")
