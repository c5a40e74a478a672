"""What the staging fabric adds to tcp: device buffers through recycled host slots, a send's copy
ordered after its producer, a receive complete only once its bytes are on the device, posting order
kept between staged and host messages, and host buffers left as they are."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.helpers.staged_devices import DoubleDevices
from tests.helpers.transfer_fabrics import local_table
from transfer.core import Deadline, Stream
from transfer.errors import FabricClosed, PeerGone, PeerTimeout
from transfer.fabric import Fabric
from transfer.staged import StagedFabric
from transfer.tcp.fabric import TcpFabric

CHUNK = 64 << 10


def _pattern(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[StagedFabric, StagedFabric]]:
    delays, depth = getattr(request, "param", ((0.0005, 0.0005), 4))
    table = local_table(2)
    fabrics = [StagedFabric(TcpFabric(table, r), DoubleDevices(delays[r]), depth=depth) for r in range(2)]
    yield fabrics[0], fabrics[1]
    for fabric in fabrics:
        fabric.close()


def _devices(fabric: StagedFabric) -> DoubleDevices:
    assert isinstance(fabric.devices, DoubleDevices)
    return fabric.devices


def test_slots_are_recycled_across_many_messages(pair: tuple[StagedFabric, StagedFabric]) -> None:
    a, b = pair
    count = 200
    src, dst = _pattern(count * CHUNK, 1), np.zeros(count * CHUNK, np.uint8)
    a.register("kv", src)
    b.register("kv", dst)
    deadline = Deadline.after(30)
    recvs = [b.recv(0, "kv", [(i * CHUNK, CHUNK)], Stream.KV, deadline) for i in range(count)]
    sends = [a.send(1, "kv", [(i * CHUNK, CHUNK)], Stream.KV, deadline) for i in range(count)]
    for handle in [*sends, *recvs]:
        handle.wait(deadline)
    assert np.array_equal(src, dst)
    for fabric in (a, b):  # one lane each way: at most `depth` slots of one chunk, made once
        made = _devices(fabric).slots_made
        assert 2 <= len(made) <= fabric.depth and set(made) == {CHUNK}
        assert fabric.staging_bytes() == len(made) * CHUNK


@pytest.mark.parametrize("pair", [((0.0, 0.3), 4)], indirect=True)
def test_a_receive_completes_only_once_its_bytes_are_on_the_device(
    pair: tuple[StagedFabric, StagedFabric],
) -> None:
    a, b = pair  # the receiver's host→device copies take 0.3 s each
    src, dst = _pattern(CHUNK, 2), np.zeros(CHUNK, np.uint8)
    a.register("kv", src)
    b.register("kv", dst)
    deadline = Deadline.after(10)
    recv = b.recv(0, "kv", [(0, CHUNK // 2), (CHUNK // 2, CHUNK // 2)], Stream.KV, deadline)
    a.send(1, "kv", [(0, CHUNK)], Stream.KV, deadline).wait(deadline)
    recv.wait(deadline)
    assert np.array_equal(dst, src), "the handle completed before the host→device copy had finished"


def test_a_send_copies_only_after_the_kernels_that_produce_its_bytes(
    pair: tuple[StagedFabric, StagedFabric],
) -> None:
    a, b = pair
    src, dst = np.zeros(CHUNK, np.uint8), np.zeros(CHUNK, np.uint8)
    a.register("kv", src)
    b.register("kv", dst)
    expected = _pattern(CHUNK, 3)

    def kernel() -> None:
        src[:] = expected

    _devices(a).launch(kernel, seconds=0.3)  # still running when the send is posted
    deadline = Deadline.after(10)
    recv = b.recv(0, "kv", [(0, CHUNK)], Stream.KV, deadline)
    a.send(1, "kv", [(0, CHUNK)], Stream.KV, deadline).wait(deadline)
    recv.wait(deadline)
    assert np.array_equal(dst, expected), "the send read the buffer before its producer had written it"


@pytest.mark.parametrize("pair", [((0.2, 0.2), 4)], indirect=True)
def test_host_messages_keep_their_place_behind_staged_ones(pair: tuple[StagedFabric, StagedFabric]) -> None:
    a, b = pair  # slow copies: a host message posted later must not overtake them
    src, dst = _pattern(CHUNK, 4), np.zeros(CHUNK, np.uint8)
    header_out, header_in = bytearray(b"H" * 100), bytearray(100)
    trailer_out, trailer_in = bytearray(b"T" * 7), bytearray(7)
    for fabric, (kv, head, tail) in ((a, (src, header_out, trailer_out)), (b, (dst, header_in, trailer_in))):
        fabric.register("kv", kv)
        fabric.register("head", head)
        fabric.register("tail", tail)
    deadline = Deadline.after(10)
    recvs = [b.recv(0, "head", [(0, 100)], Stream.KV, deadline),
             b.recv(0, "kv", [(0, CHUNK)], Stream.KV, deadline),
             b.recv(0, "tail", [(0, 7)], Stream.KV, deadline)]
    sends = [a.send(1, "head", [(0, 100)], Stream.KV, deadline),
             a.send(1, "kv", [(0, CHUNK)], Stream.KV, deadline),
             a.send(1, "tail", [(0, 7)], Stream.KV, deadline)]
    for handle in [*sends, *recvs]:
        handle.wait(deadline)
    assert header_in == header_out and trailer_in == trailer_out and np.array_equal(dst, src)


def test_host_buffers_go_to_the_inner_fabric_untouched(pair: tuple[StagedFabric, StagedFabric]) -> None:
    a, b = pair
    out, into = bytearray(b"x" * 5000), bytearray(5000)
    assert a.register("h", out) == 5000
    b.register("h", into)
    assert isinstance(a.inner, TcpFabric) and a.inner.buffers.view("h").obj is out
    deadline = Deadline.after(10)
    recv = b.recv(0, "h", [(0, 5000)], 1, deadline)
    a.send(1, "h", [(0, 5000)], 1, deadline).wait(deadline)
    recv.wait(deadline)
    assert into == out
    for fabric in (a, b):
        assert _devices(fabric).slots_made == [] and _devices(fabric).marks == 0


def test_staged_and_plain_tcp_fabrics_talk_to_each_other() -> None:
    table = local_table(2)
    staged, plain = StagedFabric(TcpFabric(table, 0), DoubleDevices(0.001)), TcpFabric(table, 1)
    try:
        device, host = _pattern(3 * CHUNK, 5), np.zeros(3 * CHUNK, np.uint8)
        staged.register("kv", device)
        plain.register("kv", host)  # host memory: tcp registers it as it is
        deadline = Deadline.after(10)
        segments = [(0, CHUNK), (2 * CHUNK, CHUNK)]
        recv = plain.recv(0, "kv", segments, 1, deadline)
        staged.send(1, "kv", segments, 1, deadline).wait(deadline)
        recv.wait(deadline)
        back = plain.send(0, "kv", [(0, CHUNK)], 2, deadline)
        staged.recv(1, "kv", [(CHUNK, CHUNK)], 2, deadline).wait(deadline)
        back.wait(deadline)
        assert np.array_equal(host[:CHUNK], device[:CHUNK])
        assert np.array_equal(device[CHUNK : 2 * CHUNK], host[:CHUNK])
    finally:
        staged.close()
        plain.close()


@pytest.mark.parametrize("pair", [((0.0005, 0.0005), 1)], indirect=True)
def test_a_receive_still_waiting_for_a_slot_can_be_withdrawn(pair: tuple[StagedFabric, StagedFabric]) -> None:
    a, b = pair  # depth 1: the second receive waits for the first one's slot
    src, dst = _pattern(3 * CHUNK, 6), np.zeros(3 * CHUNK, np.uint8)
    a.register("kv", src)
    b.register("kv", dst)
    deadline = Deadline.after(10)
    first = b.recv(0, "kv", [(0, CHUNK)], 1, deadline)
    waiting = b.recv(0, "kv", [(CHUNK, CHUNK)], 1, deadline)
    assert b.withdraw(0, 1, waiting, PeerTimeout("given up"))
    with pytest.raises(PeerTimeout, match="given up"):
        waiting.wait(deadline)
    third = b.recv(0, "kv", [(2 * CHUNK, CHUNK)], 1, deadline)
    for i in range(2):
        a.send(1, "kv", [(i * CHUNK, CHUNK)], 1, deadline).wait(deadline)
    first.wait(deadline)
    third.wait(deadline)
    assert np.array_equal(dst[:CHUNK], src[:CHUNK])
    assert np.array_equal(dst[2 * CHUNK :], src[CHUNK : 2 * CHUNK])


@pytest.mark.parametrize("pair", [((0.0005, 0.0005), 1)], indirect=True)
def test_abort_fails_staged_sends_and_gives_their_slots_back(pair: tuple[StagedFabric, StagedFabric]) -> None:
    a, b = pair
    src, dst = _pattern(4 * CHUNK, 7), np.zeros(4 * CHUNK, np.uint8)
    a.register("kv", src)
    b.register("kv", dst)
    deadline = Deadline.after(10)
    _devices(a).launch(lambda: None, seconds=0.5)  # a slow producer: the sends stay staged meanwhile
    sends = [a.send(1, "kv", [(i * CHUNK, CHUNK)], 1, deadline) for i in range(4)]  # one copying, 3 waiting
    time.sleep(0.1)
    a.abort(1, 1, "test")
    for handle in sends:
        with pytest.raises(PeerGone):
            handle.wait(deadline)
    time.sleep(0.6)  # the copy under way ends and its slot goes back
    assert a.slots_in_use() == 0
    recv = b.recv(0, "kv", [(0, CHUNK)], 1, deadline)  # the pair works again
    a.send(1, "kv", [(0, CHUNK)], 1, deadline).wait(deadline)
    recv.wait(deadline)
    assert np.array_equal(dst[:CHUNK], src[:CHUNK])


def test_a_message_over_the_staging_budget_is_refused_at_once() -> None:
    table = local_table(1)
    fabric: Fabric = StagedFabric(TcpFabric(table, 0), DoubleDevices(), max_staging_bytes=1000)
    try:
        fabric.register("kv", np.zeros(5000, np.uint8))
        with pytest.raises(ValueError, match="staging budget"):
            fabric.send(0, "kv", [(0, 2000)], 1, Deadline.after(1))
        with pytest.raises(ValueError, match="outside buffer"):
            fabric.send(0, "kv", [(4000, 2000)], 1, Deadline.after(1))
    finally:
        fabric.close()
    with pytest.raises(FabricClosed):
        fabric.send(0, "kv", [(0, 10)], 1, Deadline.after(1))
