"""The NCCL fabric's hardware-free helpers and the rendezvous implementations."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.helpers.transfer_fabrics import local_table
from transfer.core import Deadline
from transfer.errors import PeerGone, PeerTimeout, TransferError
from transfer.nccl.logic import (
    cuda_pointer,
    decode_unique_id,
    device_pieces,
    edge_key,
    encode_unique_id,
    map_nccl_error,
    warmup_peers,
)
from transfer.ranktable import RankTable
from transfer.rendezvous import DictRendezvous, FileRendezvous


def test_unique_id_round_trip() -> None:
    signed = tuple(range(-64, 64))
    raw = encode_unique_id(signed)
    assert len(raw) == 128 and decode_unique_id(raw) == signed
    with pytest.raises(TransferError, match="128"):
        encode_unique_id(b"short")


def test_device_pieces_split_at_the_nccl_count_limit() -> None:
    pieces = device_pieces(1000, [(0, 10), (50, 25)], limit=10)
    assert pieces == [(1000, 10), (1050, 10), (1060, 10), (1070, 5)]
    assert device_pieces(0, []) == []


def test_error_mapping() -> None:
    assert isinstance(map_nccl_error(6, "x"), PeerGone)
    assert isinstance(map_nccl_error(2, "x"), PeerGone)
    assert isinstance(map_nccl_error(7, "x"), PeerTimeout)
    usage = map_nccl_error(5, "x")
    assert type(usage) is TransferError and "invalid usage" in str(usage)
    assert "status 1" in str(map_nccl_error(1, "x"))


def test_warmup_peers_are_the_same_node_ones() -> None:
    base = {"host": "h", "device": "cuda"}
    table = RankTable.from_records([
        {**base, "rank": 0, "node": "a", "transfer_address": "h:1"},
        {**base, "rank": 1, "node": "a", "transfer_address": "h:2"},
        {**base, "rank": 2, "node": "b", "transfer_address": "h:3"},
    ])
    assert warmup_peers(table, 0) == [1] and warmup_peers(table, 2) == []
    assert edge_key(2, 0, 1, 3) != edge_key(2, 1, 0, 3)


class _FakeDeviceArray:
    def __init__(self, strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {"data": (4096, False), "shape": (4, 8), "typestr": "<f2",
                                         "strides": strides, "version": 3}


def test_cuda_pointer_reads_the_array_interface() -> None:
    assert cuda_pointer(_FakeDeviceArray()) == (4096, 64)
    with pytest.raises(ValueError, match="contiguous"):
        cuda_pointer(_FakeDeviceArray(strides=(2, 8)))
    with pytest.raises(TypeError, match="not device memory"):
        cuda_pointer(bytearray(4))


@pytest.mark.parametrize("kind", ["dict", "file"])
def test_rendezvous_waits_for_publication(kind: str, tmp_path: Path) -> None:
    rendezvous = DictRendezvous() if kind == "dict" else FileRendezvous(tmp_path)
    timer = threading.Timer(0.05, lambda: rendezvous.publish("nccl/uid/1", b"abc"))
    timer.start()
    assert rendezvous.lookup("nccl/uid/1", Deadline.after(5)) == b"abc"
    timer.join()
    with pytest.raises(PeerTimeout, match="missing"):
        rendezvous.lookup("missing", Deadline.after(0.05))


def test_local_table_helper_is_one_node() -> None:
    table = local_table(3)
    assert len({entry.node for entry in table}) == 1 and len(table) == 3
