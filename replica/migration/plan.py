"""What a migration moves, as pure numbers (no torch, no grpc): regions of the KV buffer and the header.

Both sides derive the same order from the Batch message: for each layer of the range, for each
request in batch order, its first `ceil(prompt_len / block_size)` pages (the pages holding the
prompt's K/V) less the leading ones the receiver holds already in its prefix cache (`SeqPages.skip`,
from the receiver's `Have` record), each page `page_bytes` bytes at
`(layer * num_blocks + page) * page_bytes` of the layer-major cache
`(layers, blocks, 2, block_size, kv_heads, head_dim)`; pages adjacent in the buffer form one region.
The two sides' page ids (and so their regions) differ; the logical byte order and the total are the
same, which is all the transfer layer needs.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

Region = tuple[int, int]
"""(byte offset, length) inside the registered KV buffer."""

# magic, batch id, nonce, first layer, stop layer, bytes, streamed, requests, chunk tokens
_HEADER = struct.Struct("!IQQIIQBII")
_MAGIC = 0x4B564D32  # "KVM2"
HEADER_BYTES = _HEADER.size
_HAVE = struct.Struct("!QBI")  # nonce, status, requests; then a message of one u32 per request
_COUNT = struct.Struct("!I")
HAVE_BYTES = _HAVE.size


class LayerHalf(enum.Enum):
    """Which layers a (partial) migration moves."""

    ALL = 0
    FIRST = 1  # [0, k)
    SECOND = 2  # [k, L)


def layer_range(half: LayerHalf, split: int, num_layers: int) -> range:
    """The layers of `half` for a split after `split` layers (ignored for ALL)."""
    if half is LayerHalf.ALL:
        return range(num_layers)
    if not 0 < split < num_layers:
        raise ValueError(f"num_layer must be in [1, {num_layers - 1}] for a partial migration, got {split}")
    return range(0, split) if half is LayerHalf.FIRST else range(split, num_layers)


@dataclass(frozen=True)
class CacheGeometry:
    """The numbers that place a page of a layer inside the KV buffer."""

    num_blocks: int
    block_size: int
    page_bytes: int  # one page of one layer: K block + V block

    def offset(self, layer: int, page: int) -> int:
        """Byte offset of page `page` of layer `layer`."""
        return (layer * self.num_blocks + page) * self.page_bytes

    def prompt_pages(self, prompt_len: int) -> int:
        """Pages holding a prompt of `prompt_len` tokens."""
        return -(-prompt_len // self.block_size)


@dataclass(frozen=True)
class SeqPages:
    """One request of the migrated batch: its prompt length and its page ids on this side."""

    prompt_len: int
    pages: tuple[int, ...]
    skip: int = 0  # leading prompt pages the receiver holds already: not moved


def layer_regions(geometry: CacheGeometry, seqs: Sequence[SeqPages], layer: int) -> list[Region]:
    """Regions of one layer, in the agreed order (request order, then page order).

    Pages that follow each other in the buffer are merged into one region (a fresh batch's pages
    usually are consecutive ids): the transfer layer's bookkeeping is per region, in Python, and a
    1 GiB batch of 16 KiB pages would otherwise be 65536 of them. The byte order is unchanged, so
    the two sides still agree on every logical byte even where their merges differ.
    """
    return _regions(geometry, _page_runs(geometry, seqs), layer)


def _regions(geometry: CacheGeometry, page_runs: Sequence[tuple[int, int]], layer: int) -> list[Region]:
    regions: list[Region] = []
    for first, count in page_runs:
        _extend(regions, geometry.offset(layer, first), count * geometry.page_bytes)
    return regions


def _extend(spans: list[tuple[int, int]], start: int, length: int) -> None:
    """Append the span (start, length), merged into the last one if it continues it."""
    if spans and spans[-1][0] + spans[-1][1] == start:
        spans[-1] = (spans[-1][0], spans[-1][1] + length)
    else:
        spans.append((start, length))


def _page_runs(geometry: CacheGeometry, seqs: Sequence[SeqPages]) -> list[tuple[int, int]]:
    """The prompt pages of every request as (first page id, count) runs of consecutive ids."""
    out: list[tuple[int, int]] = []
    for seq in seqs:
        count = geometry.prompt_pages(seq.prompt_len)
        if count > len(seq.pages):
            raise ValueError(f"a prompt of {seq.prompt_len} tokens needs {count} pages, has {len(seq.pages)}")
        for page in seq.pages[min(seq.skip, count) : count]:
            _extend(out, page, 1)
    return out


def runs(
    geometry: CacheGeometry, seqs: Sequence[SeqPages], layers: range, streamed: bool
) -> list[list[Region]]:
    """The p2p runs of a migration: one per layer when streamed, else one over every layer's regions."""
    page_runs = _page_runs(geometry, seqs)
    per_layer = [_regions(geometry, page_runs, layer) for layer in layers]
    if streamed:
        return per_layer
    merged: list[Region] = []
    for regions in per_layer:  # the last page of a layer may sit right before the next layer's first
        for offset, length in regions:
            _extend(merged, offset, length)
    return [merged]


def total_bytes(geometry: CacheGeometry, seqs: Sequence[SeqPages], layers: range) -> int:
    """Bytes a migration of `layers` moves (skipped pages left out)."""
    pages = sum(max(geometry.prompt_pages(s.prompt_len) - s.skip, 0) for s in seqs)
    return pages * geometry.page_bytes * len(layers)


@dataclass(frozen=True)
class Header:
    """The first message of every migration on a pair's KV stream: which batch, which layers, how much."""

    batch_id: int
    nonce: int  # the acknowledgement tag of this attempt (a retry gets a new one)
    layers: range
    nbytes: int
    streamed: bool = False  # one p2p run per layer (produced during a prefill), else one run for all
    num_seqs: int = 0  # requests in the batch: the size of the receiver's `Have` record
    chunk_tokens: int = 0  # streamed: the sender's prefill chunk (its runs follow `chunk_schedule`)

    def pack(self) -> bytes:
        """Wire form."""
        layers, streamed = self.layers, int(self.streamed)
        fields = (self.batch_id, self.nonce, layers.start, layers.stop, self.nbytes, streamed, self.num_seqs,
                  self.chunk_tokens)
        return _HEADER.pack(_MAGIC, *fields)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Header:
        """Parse; raises ValueError on a bad magic."""
        magic, batch_id, nonce, start, stop, nbytes, streamed, num_seqs, chunk = _HEADER.unpack(
            bytes(data[:HEADER_BYTES])
        )
        if magic != _MAGIC:
            raise ValueError(f"not a migration header (magic {magic:#x})")
        return cls(batch_id, nonce, range(start, stop), nbytes, bool(streamed), num_seqs, chunk)


@dataclass(frozen=True)
class Have:
    """The receiver's answer to a header, before any KV moves: go on (each request's leading prompt
    pages it already holds in its prefix cache, which the sender then skips) or refused.

    Two messages: a fixed `HAVE_BYTES` record (nonce, status, request count), then the counts
    (`counts_bytes`, none for an empty batch). A reader can so skip a stale answer of an earlier
    attempt whatever its size: read the record, then its counts, compare the nonce.
    """

    nonce: int
    ok: bool
    skips: tuple[int, ...]

    @staticmethod
    def counts_bytes(num_seqs: int) -> int:
        """Bytes of the counts message of a batch of `num_seqs` requests."""
        return _COUNT.size * num_seqs

    def pack(self) -> tuple[bytes, bytes]:
        """Wire form: the record and the counts."""
        record = _HAVE.pack(self.nonce, 1 if self.ok else 2, len(self.skips))
        return record, b"".join(_COUNT.pack(n) for n in self.skips)

    @staticmethod
    def unpack_record(data: bytes | bytearray | memoryview) -> tuple[int, bool, int]:
        """(nonce, ok, request count) of a record."""
        nonce, status, num_seqs = _HAVE.unpack(bytes(data[:HAVE_BYTES]))
        return nonce, status == 1, num_seqs

    @staticmethod
    def unpack_counts(data: bytes | bytearray | memoryview, num_seqs: int) -> tuple[int, ...]:
        """The counts of a counts message."""
        raw = bytes(data[: _COUNT.size * num_seqs])
        return tuple(_COUNT.unpack_from(raw, i * _COUNT.size)[0] for i in range(num_seqs))


def with_skips(seqs: Sequence[SeqPages], skips: Sequence[int]) -> list[SeqPages]:
    """`seqs` with the receiver's skipped page counts (ValueError when they do not match the batch)."""
    if len(skips) != len(seqs):
        raise ValueError(f"the receiver names {len(skips)} requests, the batch has {len(seqs)}")
    return [SeqPages(s.prompt_len, s.pages, k) for s, k in zip(seqs, skips, strict=True)]


def chunk_schedule(prompt_lens: Sequence[int], chunkable: Sequence[bool], budget: int) -> list[list[int]]:
    """The forwards of a prefill chunked by `budget` tokens: per forward, each request's prompt tokens
    computed once it ran (the last forward: every prompt token, the one that samples).

    Mirrors `replica.engine.chunks.PromptFeeder.chunks`: while more than `budget` tokens are left,
    one forward takes up to `budget` of them in batch order, each chunkable request keeping its last
    token for the final forward (a request asking for prompt logprobs is not chunkable). A batch that
    fits one forward (or `budget` 0) is one forward. Both ends of a streamed migration derive the
    order of its runs from it (`forward_runs`).
    """
    done = [0] * len(prompt_lens)
    forwards: list[list[int]] = []
    while budget > 0 and sum(p - d for p, d in zip(prompt_lens, done, strict=True)) > budget:
        ends, left = list(done), budget
        for i, (length, ok) in enumerate(zip(prompt_lens, chunkable, strict=True)):
            take = min(length - 1 - ends[i], left) if ok else 0
            if take > 0:
                ends[i] += take
                left -= take
            if not left:
                break
        if ends == done:
            break
        forwards.append(ends)
        done = ends
    forwards.append(list(prompt_lens))
    return forwards


def forward_runs(
    geometry: CacheGeometry, seqs: Sequence[SeqPages], layers: range, schedule: Sequence[Sequence[int]]
) -> list[list[Region]]:
    """The p2p runs of a migration streamed as a chunked prefill makes its KV: for each forward of
    `schedule`, for each layer, the prompt pages that forward completed (the last forward: every
    page left, its partial last one too), skipped pages left out. One forward is `runs(streamed=True)`."""
    out: list[list[Region]] = []
    sent = [min(s.skip, geometry.prompt_pages(s.prompt_len)) for s in seqs]
    for f, ends in enumerate(schedule):
        final = f == len(schedule) - 1
        upto = [geometry.prompt_pages(s.prompt_len) if final else max(e // geometry.block_size, k)
                for s, e, k in zip(seqs, ends, sent, strict=True)]
        page_runs: list[tuple[int, int]] = []
        for seq, first, stop in zip(seqs, sent, upto, strict=True):
            for page in seq.pages[first:stop]:
                _extend(page_runs, page, 1)
        out.extend(_regions(geometry, page_runs, layer) for layer in layers)
        sent = upto
    return out
