"""The cuda-ipc fabric's pure logic: piece pairing, ticket and answer encoding, control streams."""

from __future__ import annotations

import pytest

from transfer.core import control_stream
from transfer.errors import TransferError
from transfer.ipc.logic import (
    AnswerStatus,
    ControlStreams,
    Piece,
    Ticket,
    TicketHeader,
    TicketKind,
    decode_answer,
    encode_answer,
    pair_pieces,
)


def test_pieces_cut_at_both_sides_boundaries() -> None:
    assert pair_pieces([(0, 10), (100, 5)], [(50, 3), (60, 12)]) == [
        Piece(0, 50, 3), Piece(3, 60, 7), Piece(100, 67, 5)]


def test_contiguous_pieces_merge_and_empty_segments_vanish() -> None:
    assert pair_pieces([(0, 4), (4, 4), (8, 0)], [(16, 2), (18, 6)]) == [Piece(0, 16, 8)]
    assert pair_pieces([], [(3, 0)]) == []


def test_pieces_cover_every_byte_once() -> None:
    gather, scatter = [(0, 7), (20, 13), (40, 1)], [(5, 1), (9, 19), (30, 1)]
    moved = [(p.src + i, p.dst + i) for p in pair_pieces(gather, scatter) for i in range(p.nbytes)]
    src = [o + i for o, n in gather for i in range(n)]
    dst = [o + i for o, n in scatter for i in range(n)]
    assert moved == list(zip(src, dst, strict=True))


def test_totals_must_match() -> None:
    with pytest.raises(ValueError):
        pair_pieces([(0, 3)], [(0, 4)])


def test_ticket_round_trip() -> None:
    ticket = Ticket(TicketKind.TICKET, 7, ((0, 4096), (8192, 100)), "kv#3", b"\x01handle")
    header = TicketHeader.decode(ticket.header())
    assert header.body_len == len(ticket.body())
    assert header.ticket(ticket.body()) == ticket


def test_cancel_has_no_body_and_garbage_is_refused() -> None:
    cancel = Ticket(TicketKind.CANCEL, 3)
    assert cancel.body() == b""
    assert TicketHeader.decode(cancel.header()).ticket(b"") == cancel
    with pytest.raises(TransferError):
        TicketHeader.decode(b"X" * len(cancel.header()))


def test_answer_round_trip() -> None:
    assert decode_answer(encode_answer(2**40, AnswerStatus.CANCELED)) == (2**40, AnswerStatus.CANCELED)


def test_control_streams_are_distinct_for_data_and_control_streams() -> None:
    streams = [*range(50), *(control_stream(s) for s in range(50))]
    used = [inner for s in streams for inner in ControlStreams.of(s).all()]
    assert len(set(used)) == len(used) and min(used) >= 0
