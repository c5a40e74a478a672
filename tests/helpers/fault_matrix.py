"""Helpers of the fault matrix (tests/cluster/faults): requests in flight with their outcomes and
times, the router's view of its replicas, and healing a killed replica.

    with Flight(cluster, n=6) as flight:          # n concurrent completions, streamed
        wait_for(lambda: migrating_into(admin) ...)
        ...kill something...
    flight.check(deadline_s)                      # every request finished or failed clearly, in time
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
import httpx

from pdcluster.bench.soak.probe import children
from pdcluster.cluster.local import LocalCluster
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from tests.helpers.router_cluster import wait_pages_free


@dataclass
class Result:
    """One request: `finished` (a finish reason arrived), else the clear error the client got."""

    finished: bool
    error: str
    seconds: float
    events: int = 0
    decode_replica: int | None = None  # the router's id of the replica that decoded it (its route)


@dataclass
class Flight:
    """`n` streamed completions sent at once on threads; `results` once they ended."""

    url: str
    model: str
    n: int = 6
    prompt_len: int = 300
    max_tokens: int = 8
    timeout: float = 120.0
    results: list[Result] = field(default_factory=list)
    first_token: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Flight:
        for i in range(self.n):
            thread = threading.Thread(target=self._one, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.join()

    def join(self) -> None:
        """Wait until every request ended (each has the client's timeout)."""
        for thread in self._threads:
            thread.join(self.timeout + 30)

    def _one(self, i: int) -> None:
        prompt = [3 + (i * 37 + k * 11) % 400 for k in range(self.prompt_len)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        start, events = time.monotonic(), 0
        try:
            url = f"{self.url}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=self.timeout) as answer:
                if answer.status_code != 200:
                    answer.read()
                    self._end(False, f"HTTP {answer.status_code}: {answer.text[:200]}", start, events)
                    return
                for line in answer.iter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk: dict[str, Any] = json.loads(line[5:])
                    if "error" in chunk:
                        self._end(False, f"stream error: {chunk['error']}", start, events)
                        return
                    events += 1
                    self.first_token.set()
                    if chunk["choices"][0].get("finish_reason"):
                        route = chunk.get("pdcluster_route") or {}
                        self._end(True, "", start, events, route.get("decode_replica"))
                        return
            self._end(False, "the stream ended without a finish", start, events)
        except httpx.HTTPError as exc:  # the router went away: the connection broke
            self._end(False, f"{type(exc).__name__}: {exc}", start, events)

    def _end(self, finished: bool, error: str, start: float, events: int, decoder: int | None = None
             ) -> None:
        self.results.append(Result(finished, error, time.monotonic() - start, events, decoder))

    def check(self, deadline_s: float, clear: tuple[str, ...] = ("HTTP 5", "stream error")) -> list[Result]:
        """Every request ended within `deadline_s`, finished or with an error that starts like one of
        `clear`; returns the results."""
        assert len(self.results) == self.n, f"{self.n - len(self.results)} requests never ended"
        for r in self.results:
            assert r.seconds < deadline_s, f"a request took {r.seconds:.1f} s (deadline {deadline_s} s): {r}"
            assert r.finished or r.error.startswith(clear), f"unclear failure: {r}"
        return self.results


class Admin:
    """The router's admin service."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.RouterAdminStub(self.channel)
        self.metadata = (("x-admin-token", token),)

    def replicas(self) -> dict[int, pb.ReplicaStatus]:
        """Every replica by rank."""
        answer = self.stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)
        return {r.rank: r for r in answer.replicas}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (a replica's gRPC front child)."""
    found = children(pid)
    return found + [d for c in found for d in descendants(c)]


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` every 20 ms until truthy; fail the test after `timeout` s."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def heal(cluster: LocalCluster, admin: Admin, rank: int, timeout: float = 120.0) -> None:
    """Restart replica `rank` (same rank and port) and wait until the router serves with it again and
    every replica has all its pages back."""
    proc = cluster.restart_replica(rank)
    cluster.wait_replica(proc, timeout)
    ready = time.monotonic()

    def heard_since_ready() -> bool:
        # the router's last answer from the rank came from the new process (an answer on its port
        # before it was ready, and a call failing on the old connection after, can flap its state)
        status, since = admin.replicas()[rank], time.monotonic() - ready
        return status.role != pb.REPLICA_ROLE_DEAD and 0 <= status.last_heartbeat_age_s < since

    wait_for(heard_since_ready, timeout, f"rank {rank} taken back")
    pages_back(cluster, range(len(cluster.replicas)))


def pages_back(cluster: LocalCluster, ranks: range | list[int], timeout: float = 60.0) -> None:
    """Every replica of `ranks` has all its pages free (within `timeout`)."""
    infos = wait_pages_free([cluster.replicas[r].address for r in ranks], timeout)
    assert [(i.num_blocks_free, i.num_blocks_total) for i in infos] == [
        (i.num_blocks_total, i.num_blocks_total) for i in infos]
