"""The executor against a recording fabric: windows per edge, forwarding only after receipt,
region callbacks only when every chunk of a region is in, abort on failure."""

from __future__ import annotations

import threading

import pytest

from tests.helpers.transfer_fabrics import local_table
from transfer.core import Deadline, Handle, Segments
from transfer.errors import PeerGone
from transfer.executor import Executor, ExecutorOptions
from transfer.fabric import Fabric
from transfer.plans import plan_chain
from transfer.regions import RegionMap


class RecordingFabric(Fabric):
    """Records every post; the test completes handles by hand."""

    def __init__(self, rank: int) -> None:
        super().__init__(local_table(3), rank)
        self.posts: list[tuple[str, int, list[tuple[int, int]], Handle]] = []
        self.aborted: list[int] = []
        self.changed = threading.Condition()

    def _post(self, kind: str, peer: int, segments: Segments) -> Handle:
        handle = Handle(sum(n for _, n in segments), kind)
        with self.changed:
            self.posts.append((kind, peer, list(segments), handle))
            self.changed.notify_all()
        return handle

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._post("send", peer, segments)

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._post("recv", peer, segments)

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        handle = Handle(0, "connect")
        handle._complete()
        return handle

    def register(self, name: str, obj: object) -> int:
        return 0

    def unregister(self, name: str) -> None:
        pass

    def set_layout(self, stream: int, descriptor: str) -> None:
        pass

    def abort(self, peer: int, stream: int, reason: str) -> None:
        self.aborted.append(peer)

    def close(self) -> None:
        pass

    def wait_posts(self, count: int) -> list[tuple[str, int, list[tuple[int, int]], Handle]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.posts) >= count, timeout=5), self.posts
            return list(self.posts)


def _start(fabric: RecordingFabric, regions: list[tuple[int, int]], landed: list[int]) -> threading.Thread:
    plan = plan_chain([0, 1, 2], 400, chunk=100)  # the middle rank: 4 receives, 4 forwards
    executor = Executor(fabric, plan, "w", RegionMap.build(regions), 2, Deadline.after(10), landed.append,
                        ExecutorOptions(window=2))
    thread = threading.Thread(target=executor.run, daemon=True)
    thread.start()
    return thread


def test_window_forwarding_and_region_readiness() -> None:
    fabric = RecordingFabric(1)
    landed: list[int] = []
    regions = [(1000, 150), (0, 250)]  # region 0 = chunks 0-1 (partly), region 1 = chunks 1-3
    thread = _start(fabric, regions, landed)
    posts = fabric.wait_posts(2)
    assert [p[0] for p in posts] == ["recv", "recv"]  # window 2, nothing forwarded before receipt
    assert posts[0][2] == [(1000, 100)] and posts[1][2] == [(1100, 50), (0, 50)]  # gather across regions
    posts[0][3]._complete()
    posts = fabric.wait_posts(4)
    assert {p[0] for p in posts[2:]} == {"send", "recv"}
    forward = next(p for p in posts[2:] if p[0] == "send")
    assert forward[1] == 2 and forward[2] == [(1000, 100)]  # chunk 0 goes on to rank 2, same bytes
    assert landed == []  # region 0 still misses its second chunk
    posts[1][3]._complete()
    fabric.wait_posts(6)
    for _ in range(20):
        pending = [p for p in fabric.wait_posts(0) if not p[3].done()]
        if not pending and not thread.is_alive():
            break
        for post in pending:
            post[3]._complete()
        thread.join(0.05)
    thread.join(5)
    assert not thread.is_alive()
    assert landed == [0, 1]  # each region exactly once, in the order they completed


def test_failure_aborts_every_edge_of_the_plan() -> None:
    fabric = RecordingFabric(1)
    landed: list[int] = []
    errors: list[BaseException] = []
    plan = plan_chain([0, 1, 2], 400, chunk=100)
    executor = Executor(fabric, plan, "w", RegionMap.build([(0, 400)]), 2, Deadline.after(10), landed.append)

    def run() -> None:
        try:
            executor.run()
        except PeerGone as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    posts = fabric.wait_posts(1)
    posts[0][3]._fail(PeerGone("rank 0 died"))
    thread.join(5)
    assert len(errors) == 1 and sorted(fabric.aborted) == [0, 2]


def test_regions_must_match_the_plan() -> None:
    with pytest.raises(ValueError, match="plan moves"):
        Executor(RecordingFabric(1), plan_chain([0, 1, 2], 400, 100), "w", RegionMap.build([(0, 10)]), 2,
                 Deadline.after(1))
