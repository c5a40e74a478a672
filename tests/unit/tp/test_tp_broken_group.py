"""A group breaks once, for its first cause, and says so to every `when_broken` callback (one given
after the break is called at once); rank 0's watch breaks it when a worker process ends, unless
the leader is stopping it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from replica.model.layout import Shard
from replica.tp.group import TpGroup, host_store
from replica.tp.leader import Leader


@pytest.fixture
def group() -> Iterator[TpGroup]:
    one = TpGroup(Shard(0, 1), host_store("127.0.0.1", 1, 10.0), torch.device("cpu"), 10.0)
    try:
        yield one
    finally:
        one.close()


def test_a_group_breaks_once_and_tells_every_callback(group: TpGroup) -> None:
    heard: list[str] = []
    group.when_broken(lambda why: heard.append(f"a: {why}"))
    group.fail("rank 1 died")
    group.fail("a later collective timed out")  # the first cause stays
    group.when_broken(lambda why: heard.append(f"b: {why}"))  # after the break: at once
    assert group.failed == "rank 1 died"
    assert heard == ["a: rank 1 died", "b: rank 1 died"]


def _wait_for(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_worker_that_ends_breaks_the_group_unless_the_leader_stops(group: TpGroup) -> None:
    worker = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    leader = Leader(group, cast(Any, None), cast(Any, None), [worker])
    leader.watch()
    _wait_for(lambda: group.failed is not None)
    assert group.failed == f"rank 1 (pid {worker.pid}) exited with 3"


def test_workers_ending_during_stop_break_nothing(group: TpGroup) -> None:
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    leader = Leader(group, cast(Any, None), cast(Any, None), [worker], stopping=True)
    leader.watch()
    for thread in [t for t in threading.enumerate() if t.name == "tp-watch-1"]:
        thread.join(timeout=10)  # the watch has seen the worker end
    assert group.failed is None
