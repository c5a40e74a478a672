"""The conformance suite every fabric must pass; each case takes a `FabricMaker`.

Run on `tcp` and `fake` by tests/component/transfer, on `nccl`/`rdma` by tests/gpu and tests/rdma
when the hardware exists.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from tests.helpers.transfer_fabrics import FabricMaker, fabric_group, run_all
from transfer.collectives import (
    TransferOptions,
    chain_broadcast,
    recv_regions,
    ring_allgather,
    send_regions,
    tanz_broadcast,
)
from transfer.core import Deadline, Stream
from transfer.errors import LayoutMismatch, PeerTimeout, TransferError
from transfer.fabric import Fabric

SMALL = TransferOptions(chunk_bytes=64 << 10, window=4, stripe_bytes=48 << 10)


def _pattern(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _ok(errors: list[BaseException | None]) -> None:
    failures = [e for e in errors if e is not None]
    if failures:
        raise AssertionError(f"ranks failed: {failures!r}") from failures[0]


def check_ordering(maker: FabricMaker) -> None:
    """Messages of one (peer, stream) pair land in posting order."""
    with fabric_group(maker, 2) as (a, b):
        count, size = 40, 1000
        src, dst = _pattern(count * size), np.zeros(count * size, np.uint8)
        a.register("x", src)
        b.register("x", dst)
        deadline = Deadline.after(20)
        recvs = [b.recv(0, "x", [(i * size, size)], 1, deadline) for i in range(count)]
        sends = [a.send(1, "x", [(i * size, size)], 1, deadline) for i in range(count)]
        for handle in [*sends, *recvs]:
            handle.wait(deadline)
        assert np.array_equal(src, dst)


def check_large_odd_sizes(maker: FabricMaker) -> None:
    """An odd-sized multi-chunk transfer arrives intact; each region reported exactly once."""
    with fabric_group(maker, 2) as (a, b):
        size = (1 << 20) + 4099
        src, dst = _pattern(size, 1), np.zeros(size, np.uint8)
        a.register("x", src)
        b.register("x", dst)
        regions = [(0, 7), (7, 300_001), (300_008, size - 300_008)]
        landed: list[int] = []
        deadline = Deadline.after(30)
        _ok(run_all([
            lambda: send_regions(a, 1, "x", regions, Stream.KV, deadline, options=SMALL),
            lambda: recv_regions(b, 0, "x", regions, Stream.KV, deadline, landed.append, SMALL),
        ]))
        assert np.array_equal(src, dst)
        assert sorted(landed) == [0, 1, 2]


def check_zero_length(maker: FabricMaker) -> None:
    """Empty messages match and complete; a zero-byte collective succeeds."""
    with fabric_group(maker, 2) as (a, b):
        a.register("x", bytearray(8))
        b.register("x", bytearray(8))
        deadline = Deadline.after(10)
        recv = b.recv(0, "x", [], 1, deadline)
        a.send(1, "x", [(3, 0)], 1, deadline).wait(deadline)
        recv.wait(deadline)
        _ok(run_all([
            lambda: send_regions(a, 1, "x", [(0, 0)], 1, deadline),
            lambda: recv_regions(b, 0, "x", [(5, 0)], 1, deadline),
        ]))


def check_scatter_gather(maker: FabricMaker) -> None:
    """Many small regions at different offsets on each side move as one transfer."""
    with fabric_group(maker, 2) as (a, b):
        page, pages = 4096, 300
        src, dst = _pattern(page * pages, 2), np.zeros(page * pages, np.uint8)
        a.register("kv", src)
        b.register("kv", dst)
        send_pages = list(range(0, pages, 2))
        recv_pages = list(reversed(range(1, pages, 2)))
        landed: list[int] = []
        deadline = Deadline.after(20)
        _ok(run_all([
            lambda: send_regions(a, 1, "kv", [(p * page, page) for p in send_pages], Stream.KV, deadline,
                                 options=SMALL),
            lambda: recv_regions(b, 0, "kv", [(p * page, page) for p in recv_pages], Stream.KV, deadline,
                                 landed.append, SMALL),
        ]))
        for s, r in zip(send_pages, recv_pages, strict=True):
            assert np.array_equal(src[s * page : (s + 1) * page], dst[r * page : (r + 1) * page])
        assert sorted(landed) == list(range(len(send_pages)))


def check_many_streams(maker: FabricMaker) -> None:
    """Eight streams in both directions at once do not block or mix each other."""
    with fabric_group(maker, 2) as fabrics:
        size, streams = 200_000, 8
        bufs = [_pattern(size * streams, 3 + r) for r in range(2)]
        outs = [np.zeros(size * streams, np.uint8) for _ in range(2)]
        for r, fabric in enumerate(fabrics):
            fabric.register("in", bufs[r])
            fabric.register("out", outs[r])
        deadline = Deadline.after(30)
        jobs: list[Callable[[], None]] = []
        for s in range(streams):
            region = [(s * size, size)]
            for r in range(2):
                me, peer = fabrics[r], 1 - r
                stream = 10 + 2 * s + r  # one direction per stream (confirmations of a pair would cross)
                jobs.append(partial(send_regions, me, peer, "in", region, stream, deadline, options=SMALL))
                jobs.append(partial(recv_regions, me, peer, "out", region, stream + 1 - 2 * r, deadline,
                                    options=SMALL))
        _ok(run_all(jobs))
        assert np.array_equal(outs[0], bufs[1]) and np.array_equal(outs[1], bufs[0])


def check_concurrent_collectives(maker: FabricMaker) -> None:
    """A chain on one stream, a ring on another and Tanz on a third run at the same time."""
    n, size = 5, 300_001
    with fabric_group(maker, n) as fabrics:
        seed = _pattern(size, 9)
        chain = [np.zeros(size, np.uint8) for _ in range(n)]
        ring = [np.zeros(size, np.uint8) for _ in range(n)]
        tanz = [np.zeros(size, np.uint8) for _ in range(n)]
        chain[1][:] = seed
        tanz[0][:] = tanz[1][:] = seed
        cuts = [size * i // n for i in range(n + 1)]
        for r, fabric in enumerate(fabrics):
            ring[r][cuts[r] : cuts[r + 1]] = seed[cuts[r] : cuts[r + 1]]
            for name, arr in (("chain", chain[r]), ("ring", ring[r]), ("tanz", tanz[r])):
                fabric.register(name, arr)
        regions = [(0, 1000), (1000, size - 1000)]
        deadline = Deadline.after(60)
        jobs: list[Callable[[], None]] = []
        for f in fabrics:
            jobs.append(partial(chain_broadcast, f, [1, 3, 0, 4, 2], "chain", regions, 20, deadline,
                                options=SMALL))
            jobs.append(partial(ring_allgather, f, [0, 1, 2, 3, 4], "ring", regions, 21, deadline,
                                options=SMALL))
        for f in fabrics[:4]:
            jobs.append(partial(tanz_broadcast, f, [0, 1], [2, 3], "tanz", regions, 22, deadline,
                                options=SMALL))
        _ok(run_all(jobs))
        for r in range(n):
            assert np.array_equal(chain[r], seed), f"chain rank {r}"
            assert np.array_equal(ring[r], seed), f"ring rank {r}"
        for r in range(4):
            assert np.array_equal(tanz[r], seed), f"tanz rank {r}"


def check_deadline(maker: FabricMaker) -> None:
    """A receive nobody answers fails with PeerTimeout at its deadline, not before, not much after."""
    with fabric_group(maker, 2) as (_, b):
        b.register("x", bytearray(100))
        start = time.monotonic()
        try:
            recv_regions(b, 0, "x", [(0, 100)], 1, Deadline.after(0.5))
        except PeerTimeout:
            pass
        else:
            raise AssertionError("the receive should have timed out")
        elapsed = time.monotonic() - start
        assert 0.45 <= elapsed < 5.0, elapsed


def check_layout_mismatch_then_retry(maker: FabricMaker) -> None:
    """Different layouts fail on both sides with LayoutMismatch; fixed layouts then succeed."""
    with fabric_group(maker, 2) as (a, b):
        src, dst = _pattern(10_000, 4), np.zeros(10_000, np.uint8)
        a.register("x", src)
        b.register("x", dst)
        a.set_layout(Stream.KV, "pages=16;heads=2")
        b.set_layout(Stream.KV, "pages=64;heads=2")

        def both(tag: int) -> list[BaseException | None]:
            deadline = Deadline.after(10)
            options = TransferOptions(tag=tag)
            return run_all([
                lambda: send_regions(a, 1, "x", [(0, 10_000)], Stream.KV, deadline, options=options),
                lambda: recv_regions(b, 0, "x", [(0, 10_000)], Stream.KV, deadline, options=options),
            ])

        start = time.monotonic()
        errors = both(tag=1)
        assert all(isinstance(e, LayoutMismatch) for e in errors), errors
        assert time.monotonic() - start < 5, "a mismatch fails at the handshake, not at the deadline"
        b.set_layout(Stream.KV, "pages=16;heads=2")
        _ok(both(tag=2))
        assert np.array_equal(src, dst)


def check_retry_after_timeout(maker: FabricMaker) -> None:
    """A chain that failed because one rank never came succeeds when retried with everyone.

    The failed attempt's connection resets can still be in flight when the retry starts (a rank
    that gave up resets its control connection; the peer's reader may see that only after it posted
    the retry's receive), so that one retry may fail too: a second retry must succeed. A fabric that
    counts resets in edge generations (`counts_resets`) must succeed at the first retry.
    """
    with fabric_group(maker, 3) as fabrics:
        size = 200_000
        bufs = [_pattern(size, 5) if r == 0 else np.zeros(size, np.uint8) for r in range(3)]
        for fabric, buf in zip(fabrics, bufs, strict=True):
            fabric.register("w", buf)
        regions = [(0, size)]
        short = Deadline.after(0.5)
        errors = run_all([partial(chain_broadcast, f, [0, 1, 2], "w", regions, 2, short, options=SMALL)
                          for f in fabrics[:2]])
        assert all(isinstance(e, TransferError) for e in errors), errors
        strict = all(getattr(f, "counts_resets", False) for f in fabrics)
        for tag in (2,) if strict else (2, 3):  # a new tag each time: stale confirmations are skipped
            deadline = Deadline.after(20)
            retry = dataclasses.replace(SMALL, tag=tag)
            errors = run_all([partial(chain_broadcast, f, [0, 1, 2], "w", regions, 2, deadline, options=retry)
                              for f in fabrics])
            if not any(errors):
                break
        _ok(errors)
        assert np.array_equal(bufs[2], bufs[0]) and np.array_equal(bufs[1], bufs[0])


def check_withdraw(maker: FabricMaker) -> None:
    """A receive taken back before its message came leaves the pair as it was: the connection stays
    up and the sender's next message goes to the next receive. A finished receive cannot be taken
    back; a fabric that cannot take receives back at all says so (False) and keeps the receive."""
    with fabric_group(maker, 2) as (a, b):
        src, dst = _pattern(3000, 6), np.zeros(3000, np.uint8)
        a.register("x", src)
        b.register("x", dst)
        deadline = Deadline.after(20)
        first = b.recv(0, "x", [(0, 1000)], 1, deadline)  # a first message: the pair is connected
        a.send(1, "x", [(0, 1000)], 1, deadline).wait(deadline)
        first.wait(deadline)
        assert not b.withdraw(0, 1, first, PeerTimeout("too late"))
        waiting = b.recv(0, "x", [(1000, 1000)], 1, deadline)
        time.sleep(0.05)  # posted for good (a fabric may hand it on to a thread)
        if b.withdraw(0, 1, waiting, PeerTimeout("given up")):
            try:
                waiting.wait(deadline)
            except PeerTimeout as exc:
                assert "given up" in str(exc)
            else:
                raise AssertionError("a withdrawn receive must fail with the given error")
            segment = [(1000, 2000)]  # the next message, of another size, goes to the next receive
            sent = a.send(1, "x", segment, 1, deadline)
            b.recv(0, "x", segment, 1, deadline).wait(deadline)
        else:
            assert type(b).withdraw is Fabric.withdraw, "only a fabric that never withdraws may refuse"
            assert not waiting.done()
            segment = [(1000, 1000)]  # the receive stays: the next message fills it
            sent = a.send(1, "x", segment, 1, deadline)
            waiting.wait(deadline)
        sent.wait(deadline)
        end = 1000 + segment[0][1]
        assert np.array_equal(src[:end], dst[:end])


# Cases that need a failed transfer to leave the fabric usable. NCCL cannot cancel one operation:
# it aborts the stream's communicator, so its fabric must be recreated instead.
RECOVERY_CASES = frozenset({"retry_after_timeout"})

CASES: dict[str, Callable[[FabricMaker], None]] = {
    "ordering": check_ordering,
    "large_odd_sizes": check_large_odd_sizes,
    "zero_length": check_zero_length,
    "scatter_gather": check_scatter_gather,
    "many_streams": check_many_streams,
    "concurrent_collectives": check_concurrent_collectives,
    "deadline": check_deadline,
    "layout_mismatch_then_retry": check_layout_mismatch_then_retry,
    "retry_after_timeout": check_retry_after_timeout,
    "withdraw": check_withdraw,
}
