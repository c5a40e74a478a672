"""The TP command channel over a real TCPStore: in order, an idle worker outlives its poll's timeout,
every reader sees every command and the last one deletes it, and a gone leader ends the wait."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from replica.tp import group as tp_group
from replica.tp.group import Command, CommandChannel, Op

TIMEOUT = datetime.timedelta(seconds=10)


def _stores(readers: int) -> tuple[dist.TCPStore, list[dist.TCPStore]]:
    leader = dist.TCPStore("127.0.0.1", 0, readers + 1, is_master=True, wait_for_workers=False,
                           timeout=TIMEOUT)
    return leader, [dist.TCPStore("127.0.0.1", leader.port, readers + 1, is_master=False, timeout=TIMEOUT)
                    for _ in range(readers)]


def test_commands_arrive_in_order_after_idle_polls_and_are_cleaned_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tp_group, "_POLL", datetime.timedelta(milliseconds=100))
    leader_store, worker_stores = _stores(2)
    leader = CommandChannel(leader_store, 2)
    workers = [CommandChannel(s, 2) for s in worker_stores]

    def late() -> None:
        time.sleep(0.5)  # several poll timeouts of an idle worker
        leader.publish(Command(Op.FORWARD, [1]))
        leader.publish(Command(Op.STOP))

    thread = threading.Thread(target=late)
    thread.start()
    for worker in workers:
        assert worker.receive() == Command(Op.FORWARD, [1])
        assert worker.receive().op is Op.STOP
    thread.join()
    assert not leader_store.check(["tp/cmd/0"]) and not leader_store.check(["tp/cmd/1"])
    assert not leader_store.check(["tp/read/0"])


def test_a_gone_leader_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_group, "_POLL", datetime.timedelta(milliseconds=100))
    leader_store, (worker_store,) = _stores(1)
    worker = CommandChannel(worker_store, 1)
    del leader_store  # the leader's process is gone: its store server closes
    with pytest.raises(RuntimeError):
        worker.receive()
