"""A migration sender lets go of its batch's pages as soon as its peer is known gone or its caller
cancelled, not when its connect grace (CONNECT_GRACE_S, 10 s) or its transfer deadline runs out.

- The receiver died after it had sent this replica a migration (so a connection from it was seen
  closing): the sender's first migration to it fails UNAVAILABLE at once, its pages come back.
- The receiver is alive but never takes the migration, and the caller cancels the Migrate: the
  sender aborts its transfer and its pages come back at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc

from protos import generate_pb2 as pb
from tests.helpers.migration_cluster import (
    CALL_TIMEOUT,
    Replica,
    code_and_cause,
    make_batch,
    migration_cluster,
    pair,
    random_prompts,
)

TRANSFER_TIMEOUT = 20.0


def _wait_for(condition: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def _prefill(replica: Replica, batch: pb.Batch) -> None:
    replica.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=CALL_TIMEOUT)


def _migrate(sender: Replica, batch: pb.Batch, receiver: Replica) -> pb.MigrateRequest:
    return pb.MigrateRequest(batch=batch, src=[sender.rank], dst=[receiver.rank])


def test_a_sender_to_a_receiver_known_gone_fails_at_once(tiny_llama: Path, tmp_path: Path) -> None:
    with migration_cluster(tiny_llama, tmp_path, 2, num_blocks=64, transfer_timeout=TRANSFER_TIMEOUT) as (
        p,
        d,
    ):
        earlier = make_batch(1, random_prompts(256, [20]), [4])  # d → p: p sees a connection from d
        _prefill(d, earlier)
        request = _migrate(d, earlier, p)
        receive = pb.ImmigrateRequest(batch=earlier, src=[d.rank], dst=[p.rank])
        pair(
            lambda: d.stub.Migrate(request, timeout=CALL_TIMEOUT),
            lambda: p.stub.Immigrate(receive, timeout=CALL_TIMEOUT),
        )
        p.stub.ClearCache(pb.ClearCacheRequest(), timeout=CALL_TIMEOUT)
        d.services.stop()  # the receiver dies: its fabric's connections and listener go away
        time.sleep(0.2)

        batch = make_batch(2, random_prompts(256, [30, 12]), [4, 4])
        _prefill(p, batch)
        start = time.monotonic()
        code, cause = code_and_cause(lambda: p.stub.Migrate(_migrate(p, batch, d), timeout=CALL_TIMEOUT))
        assert (code, cause) == (grpc.StatusCode.UNAVAILABLE, "peer")
        assert time.monotonic() - start < 3.0  # not CONNECT_GRACE_S
        _wait_for(lambda: p.free_blocks() == p.total_blocks(), timeout=3.0)


def test_a_cancelled_sender_frees_its_pages_at_once(tiny_llama: Path, tmp_path: Path) -> None:
    with migration_cluster(tiny_llama, tmp_path, 2, num_blocks=64, transfer_timeout=TRANSFER_TIMEOUT) as (
        p,
        d,
    ):
        batch = make_batch(3, random_prompts(256, [40, 25]), [4, 4])
        _prefill(p, batch)
        call = p.stub.Migrate.future(_migrate(p, batch, d), timeout=CALL_TIMEOUT)  # nobody immigrates
        time.sleep(0.5)  # the sender waits for its receiver's acknowledgement
        assert p.free_blocks() < p.total_blocks()
        call.cancel()
        assert _wait_for(lambda: p.free_blocks() == p.total_blocks(), timeout=3.0) < 3.0
        assert d.free_blocks() == d.total_blocks()
