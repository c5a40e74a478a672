"""`pdcluster up --tp 2`: a killed worker rank breaks its group, rank 0 leaves by itself (exit 1), the
supervisor restarts the whole group on its ports, the router takes it back (Health SERVING again)
and it serves transformers' greedy text again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.cluster.launch.test_up_supervision import replicas_of, up
from tests.helpers.launched import ready_fields
from tests.helpers.processes import descendants
from tests.helpers.router_cluster import GreedyOracle

pytestmark = pytest.mark.long  # ~40 s: a tp2 group started twice and a router on two cores

PROMPT = "hello there"
MAX_TOKENS = 8


def _worker_of(pid: int) -> int:
    """The `replica.tp.worker` process (rank 1) under replica process `pid`."""
    for child in descendants(pid):
        try:
            if b"replica.tp.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    raise AssertionError(f"replica {pid} has no tensor-parallel worker process")


def _text(url: str, model: Path) -> httpx.Response:
    body = {"model": model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_killed_worker_rank_restarts_its_whole_group(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory()
    launched = up(model, tmp_path, "--tp", "2", "--prefill", "0", "--decode", "1", "--strategy", "colocated",
                  "--max-restarts", "1")
    try:
        url = ready_fields(launched.ready(180))["http"]
        expected = GreedyOracle(model).text(PROMPT, MAX_TOKENS)
        assert _text(url, model).json()["choices"][0]["text"] == expected
        [replica] = replicas_of(launched.proc.pid)
        os.kill(_worker_of(replica), signal.SIGKILL)
        end = time.monotonic() + 120
        while "is serving again" not in launched.stderr:
            assert time.monotonic() < end and launched.proc.poll() is None, launched.stderr
            time.sleep(0.2)
        assert "exited with 1" in launched.stderr, launched.stderr  # rank 0 left by itself
        log = (tmp_path / "logs").glob("replica-0*.log")
        assert any("rank 0 exits 1 so that its supervisor restarts" in p.read_text() for p in log)
        while (answer := _text(url, model)).status_code != 200:  # the router's next liveness poll
            assert time.monotonic() < end, answer.text
            time.sleep(0.3)
        assert answer.json()["choices"][0]["text"] == expected
        [restarted] = replicas_of(launched.proc.pid)
        assert restarted != replica and _worker_of(restarted)  # a new group: rank 0 and its worker
        launched.proc.send_signal(signal.SIGTERM)
        assert launched.wait(60) == 0
    finally:
        launched.kill()
