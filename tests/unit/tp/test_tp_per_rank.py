"""The per-rank contract's pure parts: which ranks tp_rank t talks to (the seeds' `src[t]` heads a
chain of `dst[t::tp]`; lists of the groups' rank 0s expand), the group's readiness (a region is ready
once every rank has it), and the workers' results mapped back to statuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from replica.errors import FailedPrecondition, InvalidArgument, PeerTimeout, PeerUnavailable
from replica.model.layout import RegionKind
from replica.tp import results
from replica.tp.leader import Endpoints
from replica.tp.results import await_results, report
from replica.tp.weights import (
    GroupReadiness,
    ReportingReadiness,
    group_ranks,
    rank_lists,
    region_key,
    tp_chain,
)
from transfer.core import Deadline
from transfer.errors import LayoutMismatch, PeerGone

REGIONS = [(RegionKind.EMBED, 0), (RegionKind.LAYER, 0), (RegionKind.LAYER, 1), (RegionKind.HEAD, 0)]


def test_rank_lists_per_tp_rank() -> None:
    assert group_ranks([0, 1], 2) == [0, 1]  # a group's ranks, as the seeds give them
    assert group_ranks([2, 4], 2) == [2, 3, 4, 5]  # the groups' rank 0s
    assert group_ranks([4], 2) == [4, 5]
    assert tp_chain([0, 1], [2, 3, 4, 5], 2, 0) == [0, 2, 4]
    assert tp_chain([0, 1], [2, 3, 4, 5], 2, 1) == [1, 3, 5]
    assert tp_chain([0], [2, 4], 2, 1) == [1, 3, 5]
    assert rank_lists([0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], 2, 1) == ([1, 3], [5, 7, 9, 11])  # Tanz lanes
    with pytest.raises(InvalidArgument):
        tp_chain([0, 2], [4], 2, 0)  # two source groups: not a chain


def _store() -> dist.Store:
    return dist.HashStore()


def test_a_region_is_ready_once_every_rank_has_it() -> None:
    store = _store()
    readiness = GroupReadiness(2, False, store, 3, REGIONS)
    worker = ReportingReadiness(2, store, 1)
    readiness.track("j")
    worker.job = "j"
    readiness.mark(RegionKind.EMBED)
    assert not readiness.snapshot().embed  # ranks 1 and 2 have not reported it
    worker.mark(RegionKind.EMBED)
    store.set(region_key("j", 2, (RegionKind.EMBED, 0)), "1")
    readiness.mark(RegionKind.LAYER, 0)  # any mark re-checks what rank 0 holds
    assert readiness.snapshot().embed and readiness.snapshot().layers == 0
    readiness.finish(ok=True)  # every rank reported its result: the rest is settled
    assert readiness.snapshot().layers == 1 and not readiness.snapshot().head
    assert not store.check([region_key("j", 1, (RegionKind.EMBED, 0))])  # the reports are cleaned up


def test_a_failed_fill_marks_nothing_more() -> None:
    readiness = GroupReadiness(2, False, _store(), 2, REGIONS)
    readiness.track("j")
    readiness.mark(RegionKind.HEAD)
    readiness.finish(ok=False)
    assert readiness.snapshot().empty
    readiness.mark(RegionKind.HEAD)  # untracked (SetStatusReady, tp 1 paths): at once
    assert readiness.snapshot().head


def test_worker_results_map_to_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "REPORT_GRACE_S", 0.05)
    store = _store()
    report(store, "ok", 1, None)
    await_results(store, "ok", 2, Deadline.after(1), "x")
    cases = ((PeerGone("gone"), PeerUnavailable), (LayoutMismatch("tp"), FailedPrecondition),
             (PeerTimeout("late"), PeerTimeout))  # the last: a worker's mover already mapped it
    for error, status in cases:
        report(store, "bad", 1, error)
        with pytest.raises(status, match="tensor-parallel rank 1"):
            await_results(store, "bad", 2, Deadline.after(1), "x")
    with pytest.raises(PeerTimeout, match="did not report"):
        await_results(store, "never", 2, Deadline(0.0), "x")




def test_endpoints_only_for_ranks_the_table_puts_in_the_group(tmp_path: Path) -> None:
    def table(tp_group: dict[str, int]) -> Path:
        records = [{"rank": r, "host": "h", "node": "n", "device": "cpu", "transfer_address": f"h:{r + 1}",
                    **(tp_group if r == 1 else {})} for r in range(3)]
        path = tmp_path / f"ranks{len(tp_group)}.json"
        path.write_text(json.dumps({"ranks": records}))
        return path

    assert Endpoints.of(table({"tp_group": 0}), 0, 2) == Endpoints(table({"tp_group": 0}), 0)
    assert Endpoints.of(table({}), 0, 2) is None  # rank 1 is another replica (`pdcluster up`'s tables)
    assert Endpoints.of(table({"tp_group": 0}), 1, 2) is None  # rank 2 names no group
    assert Endpoints.of(None, 0, 2) is None
