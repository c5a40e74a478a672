"""Real processes on loopback: a rank killed mid-chain makes every other rank fail fast with a clear
error; the same chain then succeeds when retried with a restarted rank; nothing leaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.transfer_fabrics import local_table

WORKER = Path(__file__).with_name("transfer_worker.py")
ROOT = Path(__file__).resolve().parents[3]
SIZE = 32 << 20
GBPS = 0.4  # emulated link: 32 MiB take ~0.7 s per hop, plenty of time to kill a rank mid-transfer


class Worker:
    """One rank's process and its JSON-lines output."""

    def __init__(self, table: Path, rank: int, chain: str, tag: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(table), str(rank), chain, str(SIZE), str(GBPS), str(tag)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )

    def next_event(self, kind: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"worker exited before {kind!r} (code {self.proc.poll()})")
            record = json.loads(line)
            if record["event"] == kind:
                return record
        raise AssertionError(f"no {kind!r} within {timeout} s")

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def table_file(tmp_path: Path) -> Path:
    path = tmp_path / "ranks.json"
    path.write_text(local_table(3).to_json())
    return path


def test_killed_rank_fails_the_chain_everywhere_then_retry_succeeds(table_file: Path) -> None:
    workers = [Worker(table_file, r, "0,1,2", tag=0) for r in range(3)]
    try:
        for worker in workers:
            worker.next_event("ready")
        workers[2].next_event("region")  # the tail is mid-transfer: kill it now
        workers[2].proc.kill()
        for survivor in workers[:2]:
            result = survivor.next_event("result")
            assert not result["ok"] and result["error"] == "PeerGone", result
            assert result["elapsed"] < 10, result
        workers[2].stop()
        workers[2] = Worker(table_file, 2, "0,1,2", tag=1)
        workers[2].next_event("ready")
        for survivor in workers[:2]:
            survivor.say("retry")
        results = [w.next_event("result") for w in workers]
        assert all(r["ok"] for r in results), results
        assert len({r["crc"] for r in results}) == 1
        for worker in workers:
            assert worker.next_event("closed")["threads"] == 1  # close() joined every thread
    finally:
        for worker in workers:
            worker.stop()
