"""The NCCL fabric's own logic (groups, events, deadlines, layouts, warm-up) on a backend double,
through the same conformance suite as every fabric."""

from __future__ import annotations

import pytest

from tests.helpers.transfer_conformance import CASES, RECOVERY_CASES
from tests.helpers.transfer_fabrics import thread_names
from tests.helpers.transfer_nccl_double import make_nccl_double


@pytest.mark.parametrize("case", sorted(CASES))
def test_nccl_fabric_conformance_on_double(case: str) -> None:
    if case in RECOVERY_CASES:
        pytest.skip("NCCL cannot cancel an operation: a failed edge is reusable only once both sides "
                    "aborted it, which a rank that never joined the first try did not")
    before = thread_names()
    CASES[case](make_nccl_double)
    assert not thread_names() - before, "threads leaked"
