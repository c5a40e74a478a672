"""The rendezvous over a real `torch.distributed.TCPStore`: publish/lookup across threads and
processes, deadlines, incarnations, and a restarted NCCL rank (on the backend double) that meets its
peer under its new incarnation instead of its previous life's unique ids."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.transfer_fabrics import local_table, run_all
from tests.helpers.transfer_nccl_double import DoubleBackend, DoubleWorld
from transfer.core import Deadline
from transfer.errors import PeerTimeout
from transfer.nccl.fabric import NcclFabric
from transfer.rendezvous import DictRendezvous, pair_tag
from transfer.store import StoreRendezvous, StoreUnreachable, connect_store, parse_address, serve_store

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def address() -> Iterator[str]:
    server, address = serve_store()
    yield address
    del server


def test_lookup_waits_for_a_publish_from_another_thread(address: str) -> None:
    reader, writer = StoreRendezvous(connect_store(address)), StoreRendezvous(connect_store(address))
    timer = threading.Timer(0.2, writer.publish, ("nccl/uid/1/0-1/0", b"\x00\xffid"))
    timer.start()
    try:
        assert reader.lookup("nccl/uid/1/0-1/0", Deadline.after(10)) == b"\x00\xffid"
    finally:
        timer.join()


def test_lookup_sees_a_value_published_by_another_process(address: str) -> None:
    code = ("import sys; from transfer.store import StoreRendezvous, connect_store; "
            "r = StoreRendezvous(connect_store(sys.argv[1]), rank=3); r.publish('qp', b'from-child'); "
            "print(r.incarnation)")
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True,
                         cwd=ROOT, check=True, timeout=120)
    assert out.stdout.strip() == "1"
    here = StoreRendezvous(connect_store(address))
    assert here.lookup("qp", Deadline.after(5)) == b"from-child"
    assert here.incarnation_of(3, Deadline.after(5)) == 1


def test_a_lookup_past_its_deadline_raises_peer_timeout(address: str) -> None:
    rendezvous = StoreRendezvous(connect_store(address))
    started = time.monotonic()
    with pytest.raises(PeerTimeout, match="never"):
        rendezvous.lookup("never", Deadline.after(0.3))
    with pytest.raises(PeerTimeout, match="rank 9"):
        rendezvous.incarnation_of(9, Deadline.after(0.3))
    assert time.monotonic() - started < 3


def test_each_start_of_a_rank_is_a_new_incarnation(address: str) -> None:
    first = StoreRendezvous(connect_store(address), rank=1)
    other = StoreRendezvous(connect_store(address), rank=0)
    assert (first.incarnation, other.incarnation) == (1, 1)
    assert pair_tag(other, 0, 1, Deadline.after(5)) == "@1.1"
    restarted = StoreRendezvous(connect_store(address), rank=1)
    assert restarted.incarnation == 2
    assert other.incarnation_of(1, Deadline.after(5)) == 2
    assert pair_tag(other, 0, 1, Deadline.after(5)) == "@1.2"
    assert pair_tag(DictRendezvous(), 0, 1, Deadline.after(5)) == ""  # no incarnations: keys untagged


def test_an_edge_generation_moves_with_each_reset_and_each_restart_of_its_rank(address: str) -> None:
    first = StoreRendezvous(connect_store(address), rank=0)
    peer = StoreRendezvous(connect_store(address), rank=1)
    start = peer.generation(0, 1, 3)
    first.note_reset(0, 1, 3)
    assert peer.generation(0, 1, 3) != start  # rank 0 reset its end of 0-1 on stream 3
    after_reset = peer.generation(0, 1, 3)
    assert peer.generation(0, 1, 4) == peer.generation(0, 1, 4)  # other streams and directions apart
    first.note_reset(0, 1, 4)
    assert peer.generation(0, 1, 3) == after_reset and peer.generation(1, 0, 3) == peer.generation(1, 0, 3)
    StoreRendezvous(connect_store(address), rank=0)  # rank 0 restarts
    assert peer.generation(0, 1, 3) != after_reset


def test_an_unreachable_store_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("nowhere")
    from transfer.ports import free_ports

    with pytest.raises(StoreUnreachable, match="no rendezvous store answers"):
        connect_store(f"127.0.0.1:{free_ports(1)[0]}", timeout_s=0.5)


def _nccl(table: Any, rank: int, address: str, world: DoubleWorld) -> NcclFabric:
    rendezvous = StoreRendezvous(connect_store(address), rank=rank)
    return NcclFabric(table, rank, rendezvous, backend=DoubleBackend(world), warmup_streams=())


def _exchange(sender: NcclFabric, receiver: NcclFabric, payload: bytes, deadline: Deadline) -> bytes:
    src, dst = np.frombuffer(payload, np.uint8).copy(), np.zeros(len(payload), np.uint8)
    sender.register("b", src)
    receiver.register("b", dst)
    whole = [(0, len(payload))]
    errors = run_all([lambda: sender.send(receiver.rank, "b", whole, 1, deadline).wait(deadline),
                      lambda: receiver.recv(sender.rank, "b", whole, 1, deadline).wait(deadline)])
    assert errors == [None, None]
    return dst.tobytes()


def test_a_restarted_nccl_rank_meets_its_peer_under_its_new_incarnation(address: str) -> None:
    table, world = local_table(2), DoubleWorld()
    survivor, first_life = _nccl(table, 0, address, world), _nccl(table, 1, address, world)
    try:
        assert _exchange(survivor, first_life, b"life one", Deadline.after(20)) == b"life one"
        first_life.close()  # rank 1 dies; its unique id for edge 0->1 stays in the store
        survivor.abort(1, 1, "rank 1 is gone")  # what the survivor's failed send would have done
        second_life = _nccl(table, 1, address, world)
        try:
            # without incarnations in the keys, rank 1 (generation 0 again) would read the old id
            # while rank 0 (generation 1) publishes another: no shared communicator, a hang
            assert _exchange(survivor, second_life, b"life two", Deadline.after(20)) == b"life two"
        finally:
            second_life.close()
    finally:
        survivor.close()
