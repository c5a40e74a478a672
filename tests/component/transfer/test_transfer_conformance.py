"""The fabric conformance suite on the tcp and fake fabrics (always run)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.helpers.transfer_conformance import CASES
from tests.helpers.transfer_fabrics import (
    FabricMaker,
    make_fake,
    make_tcp,
    make_tcp_counting_resets,
    socket_fds,
    thread_names,
)

MAKERS: dict[str, FabricMaker] = {"tcp": make_tcp, "tcp-resets": make_tcp_counting_resets, "fake": make_fake}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_fabric_conformance(kind: str, case: str) -> None:
    threads_before, sockets_before = thread_names(), socket_fds()
    check: Callable[[FabricMaker], None] = CASES[case]
    check(MAKERS[kind])
    leaked = thread_names() - threads_before
    assert not leaked, f"threads leaked: {leaked}"
    assert socket_fds() <= sockets_before, "sockets leaked"
