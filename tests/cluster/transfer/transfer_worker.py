"""A rank in its own process, for the subprocess fault tests: runs a chain, reports JSON lines.

Usage: python transfer_worker.py TABLE.json RANK CHAIN(comma list) SIZE GBPS TAG
Prints {"event": "region", ...} as regions land, {"event": "result", ...} at the end of each attempt;
after a failed attempt it waits for "retry" on stdin and tries again with TAG+1.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import zlib

import numpy as np

from transfer.collectives import TransferOptions, chain_broadcast
from transfer.core import Deadline, Stream
from transfer.errors import TransferError
from transfer.ranktable import load_rank_table
from transfer.tcp.fabric import TcpFabric

REGIONS = 8


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def attempt(fabric: TcpFabric, chain: list[int], buf: np.ndarray, tag: int) -> bool:
    size = buf.nbytes
    regions = [(i * size // REGIONS, size // REGIONS) for i in range(REGIONS)]
    options = TransferOptions(chunk_bytes=256 << 10, tag=tag)
    start = time.monotonic()
    try:
        chain_broadcast(fabric, chain, "w", regions, Stream.PARAMS, Deadline.after(20),
                        lambda i: emit(event="region", index=i), options)
    except TransferError as exc:
        emit(event="result", ok=False, error=type(exc).__name__, message=str(exc),
             elapsed=time.monotonic() - start)
        return False
    emit(event="result", ok=True, crc=zlib.crc32(buf.tobytes()), elapsed=time.monotonic() - start)
    return True


def main() -> None:
    table_path, rank, chain_text, size, gbps, tag = sys.argv[1:7]
    chain = [int(r) for r in chain_text.split(",")]
    table = load_rank_table(table_path)
    fabric = TcpFabric(table, int(rank), intra_node_gbps=float(gbps))
    buf = np.zeros(int(size), np.uint8)
    if int(rank) == chain[0]:
        buf[:] = np.random.default_rng(7).integers(0, 256, buf.nbytes, dtype=np.uint8)
    fabric.register("w", buf)
    emit(event="ready")
    tries = int(tag)
    while not attempt(fabric, chain, buf, tries):
        if sys.stdin.readline().strip() != "retry":
            break
        tries += 1
    fabric.close()
    emit(event="closed", threads=threading.active_count())


if __name__ == "__main__":
    main()
