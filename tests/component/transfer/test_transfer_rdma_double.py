"""The RDMA fabric's protocol (tickets, write planning, immediates, windows, flushes, generations)
on a verbs double, through the same conformance suite as every fabric."""

from __future__ import annotations

import pytest

from tests.helpers.transfer_conformance import CASES, RECOVERY_CASES
from tests.helpers.transfer_fabrics import thread_names
from tests.helpers.transfer_rdma_double import make_rdma_double


@pytest.mark.parametrize("case", sorted(CASES))
def test_rdma_fabric_conformance_on_double(case: str) -> None:
    if case in RECOVERY_CASES:
        pytest.skip("a failed queue pair is reconnected only once both sides aborted it, which a rank "
                    "that never joined the first try did not")
    before = thread_names()
    CASES[case](make_rdma_double)
    assert not thread_names() - before, "threads leaked"
