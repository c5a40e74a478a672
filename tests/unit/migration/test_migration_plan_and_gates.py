"""The migration's pure parts: region order and sizes, the header, and per-pair serialisation."""

from __future__ import annotations

import threading
import time

import pytest

from replica.errors import PeerTimeout
from replica.migration.gates import InboundTurns, SendGates
from replica.migration.plan import (
    CacheGeometry,
    Have,
    Header,
    LayerHalf,
    SeqPages,
    chunk_schedule,
    forward_runs,
    layer_range,
    layer_regions,
    runs,
    total_bytes,
    with_skips,
)
from tests.helpers.eventually import eventually

GEOMETRY = CacheGeometry(num_blocks=10, block_size=4, page_bytes=100)


def test_regions_cover_the_prompt_pages_of_each_request_in_order() -> None:
    seqs = [SeqPages(prompt_len=5, pages=(7, 2, 9)), SeqPages(prompt_len=4, pages=(0, 1))]
    # request 0: 5 tokens -> pages 7, 2 (page 9 holds generated tokens only); request 1: page 0
    assert layer_regions(GEOMETRY, seqs, 0) == [(700, 100), (200, 100), (0, 100)]
    assert layer_regions(GEOMETRY, seqs, 3) == [(3700, 100), (3200, 100), (3000, 100)]
    assert total_bytes(GEOMETRY, seqs, range(0, 4)) == 3 * 100 * 4


def test_adjacent_pages_merge_and_both_sides_move_the_same_logical_bytes() -> None:
    sender = [SeqPages(9, (1, 2, 3)), SeqPages(1, (4,))]
    receiver = [SeqPages(9, (8, 0, 5)), SeqPages(1, (6,))]
    assert layer_regions(GEOMETRY, sender, 1) == [(1100, 400)]  # pages 1-4 of layer 1: one region
    assert layer_regions(GEOMETRY, receiver, 1) == [(1800, 100), (1000, 100), (1500, 200)]

    def pages(seqs: list[SeqPages]) -> list[int]:  # the page each logical 100-byte slot lands in
        regions = runs(GEOMETRY, seqs, range(4), streamed=False)[0]
        return [offset // 100 + k for offset, n in regions for k in range(n // 100)]

    assert len(pages(sender)) == len(pages(receiver)) == 4 * 4
    assert pages(sender)[:4] == [1, 2, 3, 4] and pages(receiver)[:4] == [8, 0, 5, 6]
    assert pages(receiver)[4:8] == [18, 10, 15, 16]  # layer 1: same order, shifted by num_blocks


def test_a_layers_last_page_merges_with_the_next_layers_first() -> None:
    seqs = [SeqPages(8, (0, 9))]  # layer 0's page 9 ends where layer 1's page 0 starts
    assert runs(GEOMETRY, seqs, range(2), streamed=False) == [[(0, 100), (900, 200), (1900, 100)]]
    streamed = [[(0, 100), (900, 100)], [(1000, 100), (1900, 100)]]
    assert runs(GEOMETRY, seqs, range(2), streamed=True) == streamed


def test_too_few_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 2 pages"):
        layer_regions(GEOMETRY, [SeqPages(5, (1,))], 0)


def test_layer_halves() -> None:
    assert layer_range(LayerHalf.ALL, 0, 4) == range(4)
    assert layer_range(LayerHalf.FIRST, 1, 4) == range(0, 1)
    assert layer_range(LayerHalf.SECOND, 1, 4) == range(1, 4)
    for split in (0, 4):
        with pytest.raises(ValueError):
            layer_range(LayerHalf.FIRST, split, 4)


def test_header_round_trip_and_bad_magic() -> None:
    header = Header(batch_id=2**40 + 3, nonce=12345, layers=range(2, 7), nbytes=999, num_seqs=7)
    assert Header.unpack(header.pack()) == header
    with pytest.raises(ValueError, match="not a migration header"):
        Header.unpack(bytes(len(header.pack())))


def test_pages_the_receiver_holds_are_left_out_on_both_sides() -> None:
    sender = [SeqPages(9, (1, 2, 3)), SeqPages(5, (4, 6))]
    receiver = [SeqPages(9, (8, 0, 5)), SeqPages(5, (7, 9))]
    skips = (2, 0)  # request 0's first two pages are cached on the receiver; request 1 moves whole
    assert layer_regions(GEOMETRY, with_skips(sender, skips), 0) == [(300, 200), (600, 100)]
    assert layer_regions(GEOMETRY, with_skips(receiver, skips), 0) == [(500, 100), (700, 100), (900, 100)]
    assert total_bytes(GEOMETRY, with_skips(sender, skips), range(2)) == 3 * 100 * 2
    assert total_bytes(GEOMETRY, with_skips(sender, (9, 9)), range(2)) == 0  # more than the prompt: none
    with pytest.raises(ValueError, match="names 1 requests"):
        with_skips(sender, (1,))


def test_chunk_schedule_keeps_each_last_token_for_the_sampling_forward() -> None:
    # 10 + 3 tokens in chunks of 4: 4 of the first, 4 more, then 1 of the first and 2 of the second
    # (each keeps its last token); 4 left (1 + 1 + ... ) fit the final forward
    assert chunk_schedule([10, 3], [True, True], 4) == [[4, 0], [8, 0], [9, 2], [10, 3]]
    assert chunk_schedule([10, 3], [True, True], 0) == [[10, 3]]  # no chunking
    assert chunk_schedule([10, 3], [True, True], 13) == [[10, 3]]  # fits one forward
    assert chunk_schedule([10, 3], [False, True], 4) == [[0, 2], [10, 3]]  # prompt logprobs: whole


def test_forward_runs_send_each_page_once_when_a_forward_completes_it() -> None:
    seqs = [SeqPages(9, (1, 2, 3)), SeqPages(5, (4, 6))]  # 4 tokens a page (GEOMETRY)
    assert forward_runs(GEOMETRY, seqs, range(2), [[9, 5]]) == runs(GEOMETRY, seqs, range(2), streamed=True)
    schedule = [[4, 0], [8, 3], [9, 5]]
    got = forward_runs(GEOMETRY, seqs, range(1), schedule)
    assert got == [[(100, 100)], [(200, 100)], [(300, 200), (600, 100)]]  # page 1; page 2; the rest
    assert sum(n for run in got for _, n in run) == total_bytes(GEOMETRY, seqs, range(1))
    skipped = forward_runs(GEOMETRY, with_skips(seqs, (2, 0)), range(1), schedule)
    assert skipped == [[], [], [(300, 200), (600, 100)]]  # pages 1 and 2 held by the receiver


def test_have_round_trip() -> None:
    have = Have(nonce=2**62 + 5, ok=True, skips=(3, 0, 70000))
    record, counts = have.pack()
    assert Have.unpack_record(record) == (have.nonce, True, 3)
    assert len(counts) == Have.counts_bytes(3) and Have.unpack_counts(counts, 3) == have.skips
    refused, empty = Have(1, False, ()).pack()
    assert Have.unpack_record(refused) == (1, False, 0) and empty == b""


def test_send_gate_serialises_and_times_out() -> None:
    gates = SendGates()
    release = gates.acquire(3, 1.0)
    with pytest.raises(PeerTimeout):
        gates.acquire(3, 0.05)
    gates.acquire(4, 0.05)()  # another peer is independent
    release()
    gates.acquire(3, 0.05)()


def _header(batch_id: int) -> Header:
    return Header(batch_id, 0, range(2), 10)


def test_turns_route_headers_to_their_immigrate_whatever_the_arrival_order() -> None:
    # the sender sends batch 1 then batch 2; the receiver's Immigrate(2) asks first
    stream, reads = iter([_header(1), _header(2)]), list[int]()
    turns, got, order = InboundTurns(park_seconds=5.0), {}, []

    def read() -> Header:
        reads.append(1)
        return next(stream)

    def immigrate(batch_id: int) -> None:
        header = turns.claim(9, batch_id, read, time.monotonic() + 5.0)
        order.append(batch_id)  # "receives its data" while owning the stream
        got[batch_id] = header
        turns.release(9)

    second = threading.Thread(target=immigrate, args=(2,))
    second.start()
    eventually(lambda: reads, message="Immigrate(2) reading the stream")  # it asked first
    immigrate(1)
    second.join(5)
    assert order == [1, 2] and got[1].batch_id == 1 and got[2].batch_id == 2


def test_turn_wait_has_a_deadline_and_a_parked_header_expires() -> None:
    turns = InboundTurns(park_seconds=0.1)
    with pytest.raises(PeerTimeout):  # batch 1's header came, batch 1's Immigrate never does
        turns.claim(9, 2, lambda: _header(1), time.monotonic() + 0.05)
    time.sleep(0.15)  # the parked header expired: the stream is free again
    assert turns.claim(9, 3, lambda: _header(3), time.monotonic() + 1.0).batch_id == 3
    turns.release(9)


def test_a_failed_header_read_frees_the_stream() -> None:
    turns = InboundTurns(park_seconds=1.0)

    def fail() -> Header:
        raise OSError("peer gone")

    with pytest.raises(OSError):
        turns.claim(9, 1, fail, time.monotonic() + 1.0)
    assert turns.claim(9, 1, lambda: _header(1), time.monotonic() + 1.0).batch_id == 1


def test_a_late_header_of_an_abandoned_batch_is_refused_and_the_next_one_read() -> None:
    turns, refused = InboundTurns(park_seconds=5.0), list[Header]()

    def nothing() -> Header:
        raise PeerTimeout("no header in time")

    with pytest.raises(PeerTimeout):  # batch 1's Immigrate gives up before its header came
        turns.claim(9, 1, nothing, time.monotonic() + 1.0)
    stream = iter([_header(1), _header(2)])  # batch 1's sender comes after all, then batch 2's
    header = turns.claim(9, 2, lambda: next(stream), time.monotonic() + 1.0, refuse=refused.append)
    assert header.batch_id == 2 and [h.batch_id for h in refused] == [1]
    turns.release(9)
    # refused once: a header of batch 1 that comes later again is parked like any other
    stream = iter([_header(1), _header(3)])
    with pytest.raises(PeerTimeout):
        turns.claim(9, 3, lambda: next(stream), time.monotonic() + 0.1, refuse=refused.append)
    assert len(refused) == 1


def test_an_immigrate_that_claims_its_batch_again_gets_the_header_another_reader_reads() -> None:
    turns, refused, got = InboundTurns(park_seconds=5.0), list[Header](), dict[int, Header]()

    def nothing() -> Header:
        raise PeerTimeout("no header in time")

    with pytest.raises(PeerTimeout):  # the first Immigrate of batch 1 gives up
        turns.claim(9, 1, nothing, time.monotonic() + 1.0)
    arrived, reading = threading.Event(), threading.Event()
    stream = iter([_header(1), _header(2)])

    def read() -> Header:
        reading.set()
        arrived.wait(5)
        return next(stream)

    def immigrate(batch_id: int) -> None:
        got[batch_id] = turns.claim(9, batch_id, read, time.monotonic() + 5.0, refuse=refused.append)
        turns.release(9)

    reader = threading.Thread(target=immigrate, args=(2,))  # owns the stream, waits for a header
    reader.start()
    eventually(lambda: reading.is_set(), message="Immigrate(2) reading the stream")
    retry = threading.Thread(target=immigrate, args=(1,))  # the caller retries batch 1
    retry.start()
    # the retry has claimed batch 1 (no longer abandoned) before its header is read
    eventually(lambda: (9, 1) not in turns._abandoned, message="the retry's claim")
    arrived.set()  # batch 1's header comes, read by batch 2's Immigrate: parked for the retry
    reader.join(5)
    retry.join(5)
    assert refused == [] and got[1].batch_id == 1 and got[2].batch_id == 2
