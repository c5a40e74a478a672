"""The executor and collectives on the fake fabric: region readiness, injected faults, retries."""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import numpy as np

from tests.helpers.transfer_fabrics import fabric_group, make_fake, run_all
from transfer.collectives import TransferOptions, chain_broadcast, tanz_broadcast
from transfer.core import Deadline, Rank
from transfer.errors import PeerGone, PeerTimeout, TransferError
from transfer.fake import FakeFabric, FakeFaults

OPTS = TransferOptions(chunk_bytes=1000, window=3, stripe_bytes=1500)
SIZE = 24_000
REGIONS = [(0, 100), (100, 9_900), (10_000, 14_000)]


def _buffers(n: int, sources: int) -> tuple[np.ndarray, list[np.ndarray]]:
    seed = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    return seed, [seed.copy() if r < sources else np.zeros(SIZE, np.uint8) for r in range(n)]


def test_region_is_reported_only_when_all_its_chunks_are_in_place() -> None:
    faults = FakeFaults(delay_s=0.001)
    with fabric_group(lambda n: make_fake(n, faults), 6) as fabrics:
        seed, bufs = _buffers(6, 2)
        complete_at_callback: dict[int, list[bool]] = {r: [] for r in range(6)}
        for fabric, buf in zip(fabrics, bufs, strict=True):
            fabric.register("w", buf)

        def on_region(rank: int, index: int) -> None:
            offset, length = REGIONS[index]
            done = np.array_equal(bufs[rank][offset : offset + length], seed[offset : offset + length])
            complete_at_callback[rank].append(done)

        deadline = Deadline.after(30)
        errors = run_all([
            partial(tanz_broadcast, f, [0, 1], [2, 3, 4, 5], "w", REGIONS, 2, deadline,
                    partial(on_region, r), OPTS)
            for r, f in enumerate(fabrics)
        ])
        assert errors == [None] * 6
        for r in range(2, 6):
            assert np.array_equal(bufs[r], seed)
            assert complete_at_callback[r] == [True, True, True]  # each region once, and whole
        assert complete_at_callback[0] == complete_at_callback[1] == []  # sources receive nothing


def test_dropped_message_fails_every_rank_by_the_deadline() -> None:
    faults = FakeFaults(drop=lambda src, dst, stream, seq: (src, dst, seq) == (1, 2, 5))
    with fabric_group(lambda n: make_fake(n, faults), 3) as fabrics:
        _, bufs = _buffers(3, 1)
        for fabric, buf in zip(fabrics, bufs, strict=True):
            fabric.register("w", buf)
        start = time.monotonic()
        deadline = Deadline.after(1.0)
        errors = run_all([partial(chain_broadcast, f, [0, 1, 2], "w", REGIONS, 2, deadline, options=OPTS)
                          for f in fabrics])
        assert all(isinstance(e, TransferError) for e in errors), errors
        assert isinstance(errors[2], PeerTimeout)
        assert time.monotonic() - start < 5


def test_peer_death_mid_transfer_fails_every_rank_and_retry_works() -> None:
    faults = FakeFaults(die_after_bytes={1: 5_500})
    with fabric_group(lambda n: make_fake(n, faults), 4) as fabrics:
        seed, bufs = _buffers(4, 1)
        for fabric, buf in zip(fabrics, bufs, strict=True):
            fabric.register("w", buf)
        start = time.monotonic()
        deadline = Deadline.after(3)
        errors = run_all([partial(chain_broadcast, f, [0, 1, 2, 3], "w", REGIONS, 2, deadline, options=OPTS)
                          for f in fabrics])
        assert all(isinstance(e, TransferError) for e in errors), errors
        assert isinstance(errors[0], PeerGone) and isinstance(errors[2], PeerGone)  # its neighbours
        assert time.monotonic() - start < 3.5  # a rank that posted late may wait out its deadline, no longer
        # the survivors' buffers stay registered: the same collective without the dead rank succeeds
        retry = dataclasses.replace(OPTS, tag=1)
        survivors = [f for f in fabrics if f.rank != 1]
        errors = run_all([partial(chain_broadcast, f, [0, 2, 3], "w", REGIONS, 2, Deadline.after(20),
                                  options=retry) for f in survivors])
        assert errors == [None] * 3
        assert np.array_equal(bufs[3], seed)


def test_posting_to_a_dead_or_closed_rank_fails_at_once() -> None:
    with fabric_group(make_fake, 2) as (a, b):
        assert isinstance(a, FakeFabric)
        a.register("x", bytearray(4))
        a.network.kill(Rank(1))
        handle = a.send(1, "x", [(0, 4)], 0, Deadline.after(5))
        assert isinstance(handle.error, PeerGone)
        b.close()
        assert isinstance(a.connect(1, 0, Deadline.after(1)).error, PeerGone)
