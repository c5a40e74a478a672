"""The fabric conformance suite on the staging fabric: every numpy buffer of the suite is device
memory (a slow, asynchronous CPU double), staged through host slots over tcp and over fake."""

from __future__ import annotations

import pytest

from tests.helpers.transfer_conformance import CASES
from tests.helpers.transfer_fabrics import (
    FabricMaker,
    make_staged_fake,
    make_staged_tcp,
    socket_fds,
    thread_names,
)

MAKERS: dict[str, FabricMaker] = {"staged-tcp": make_staged_tcp, "staged-fake": make_staged_fake}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_staged_fabric_conformance(kind: str, case: str) -> None:
    threads_before, sockets_before = thread_names(), socket_fds()
    CASES[case](MAKERS[kind])
    leaked = thread_names() - threads_before
    assert not leaked, f"threads leaked: {leaked}"
    assert socket_fds() <= sockets_before, "sockets leaked"
