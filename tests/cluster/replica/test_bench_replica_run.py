"""`pdcluster bench replica` end to end on a tiny model: every path runs, the report has its ratios,
and with 2+ cores the replica's engine and the in-process paths share one core (`--pin`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdcluster.bench.replica import PATHS, BenchReplicaConfig, run


def test_bench_replica_writes_every_path_and_ratio(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "replica.json"
    cores = os.sched_getaffinity(0)
    config = BenchReplicaConfig(
        json=out, model=tiny_llama, batch_sizes=[1, 2], decode_steps=3, prefill_rounds=2, repeats=1
    )
    assert run(config) == 0
    assert os.sched_getaffinity(0) == cores  # the bench put this process back where it was
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        assert all(row[path]["decode_tok_s"] > 0 and row[path]["prefill_tok_s"] > 0 for path in PATHS)
        assert row["grpc_pipelined_over_in_process"]["decode"] > 0
    placement = report["config"]["placement"]
    if len(cores) >= 2:
        assert placement == f"engine on cores [{max(cores)}], gRPC client and front on {sorted(cores)[:-1]}"
    else:
        assert placement is None
    assert report["goals"]["grpc_over_in_process_goal"] == 0.8
