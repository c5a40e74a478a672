"""A replica the autoscaler activated comes back as itself after a supervised restart, on real processes.

`pdcluster up --prefill 1 --decode 1 --inactive 1 --scaling multicast` with `min-decode=2`: the
planner activates the inactive replica as a second decode replica (weights p2p). Its process is then
killed; the supervisor of `up` restarts it (inactive, as it was started, on the same address), the
router sees the same member answer without weights, loads them again and gives it back its decode
role (`Autoscaler.restore`). Greedy tokens through it equal transformers' before and after.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from router.scaling.timeline import read
from tests.helpers.eventually import eventually
from tests.helpers.launched import Launched, pdcluster, ready_fields
from tests.helpers.processes import children_of
from tests.helpers.router_cluster import GreedyOracle

pytestmark = pytest.mark.long  # three replicas, a router, a restart and a reload: ~30-60 s on 2 cores

PROMPTS = ["the restored replica", "decodes as before", "after its restart", "with the same weights",
           "one more", "and another prompt"]
MAX_NEW = 24
INACTIVE_ID = 2  # ranks (and the router's ids) go prefill, decode, inactive


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def _complete(url: str, model: Path, prompt: str) -> dict[str, object]:
    body = {"model": model.name, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _decoded_by_restored(url: str, model: Path, oracle: GreedyOracle) -> bool:
    """The prompts at once (a decode replica busy with one batch makes the next go to the other):
    every text equals transformers'; True when the activated replica decoded one."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _complete(url, model, p), PROMPTS))
    for prompt, done in zip(PROMPTS, answers, strict=True):
        assert done["choices"][0]["text"] == oracle.text(prompt, MAX_NEW)  # type: ignore[index]
    return INACTIVE_ID in {done["pdcluster_route"]["decode_replica"] for done in answers}  # type: ignore[index]


def test_an_activated_replica_restarted_by_the_supervisor_gets_its_role_and_weights_back(
        tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model_factory()
    oracle = GreedyOracle(model)
    log, timeline = tmp_path / "logs" / "router.log", tmp_path / "timeline.jsonl"
    launched = Launched(pdcluster(
        "up", "--model", str(model), "--prefill", "1", "--decode", "1", "--inactive", "1", "--scaling",
        "multicast", "--router-flag", "min-decode=2", "keep-alive=600", f"timeline={timeline}",
        "--http-port", "0", "--admin-port", "0", "--num-blocks", "128", "--torch-threads", "1",
        "--max-restarts", "2", "--log-dir", str(tmp_path / "logs")))
    try:
        url = ready_fields(launched.ready(180))["http"]
        activated = f"replica {INACTIVE_ID}: loading_decode -> decode"
        eventually(lambda: activated in log.read_text(), 60, message="the planner activates the inactive one")
        eventually(lambda: _decoded_by_restored(url, model, oracle), 60, interval=0.5,
                   message="a request decoded by the activated replica")
        inactive = [c for c in children_of(launched.proc.pid) if "--inactive" in _cmdline(c)]
        assert len(inactive) == 1
        subprocess.run(["kill", "-KILL", str(inactive[0])], check=True)
        eventually(lambda: "is serving again" in launched.stderr, 90, message="the supervisor restarts it")
        eventually(lambda: log.read_text().count(activated) >= 2, 90, message="restored as decode")
        assert re.search(rf"replica {INACTIVE_ID} \(\S+\) answers again: back as inactive", log.read_text())
        restores = [r for r in read(timeline) if r["kind"] == "restore"]
        assert [(r["replica"], r["role"]) for r in restores] == [(INACTIVE_ID, "decode")]
        end = time.monotonic() + 60
        while not _decoded_by_restored(url, model, oracle):  # tokens equal transformers' on every try
            assert time.monotonic() < end, "the restored replica decoded no request"
        launched.proc.send_signal(signal.SIGTERM)
        assert launched.wait(60) == 0
    finally:
        launched.kill()
