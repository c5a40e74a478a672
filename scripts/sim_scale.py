"""Time one cell of an experiment file in virtual time and count the router's loop work.

    .venv/bin/python scripts/sim_scale.py examples/simulated-scale.toml 30p30d.full.static@local__r600__r0

Prints wall and virtual seconds (the cell's `simulation.json`), the replica loops' steps and the
wake-ups their waits returned on, one JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from router import loops, wakeup


def main(file: str, only: str) -> None:
    counts = {"loop_steps": 0, "wait_returns": 0}
    step, wait = loops.ReplicaWorker.step, wakeup.Wakeup.wait

    async def counted_step(self: loops.ReplicaWorker) -> bool:
        counts["loop_steps"] += 1
        return await step(self)

    async def counted_wait(self: wakeup.Wakeup, token: object = None, timeout: float | None = None) -> None:
        counts["wait_returns"] += 1
        await wait(self, token, timeout)  # type: ignore[arg-type]

    loops.ReplicaWorker.step = counted_step  # type: ignore[method-assign]
    wakeup.Wakeup.wait = counted_wait  # type: ignore[method-assign]
    from pdcluster.sim.cli import SimulateConfig, run

    with tempfile.TemporaryDirectory() as out:
        start = time.monotonic()
        rc = run(SimulateConfig(file=Path(file), out=Path(out), only=[only], force=True))
        wall = time.monotonic() - start
        sim = [json.loads(p.read_text()) for p in Path(out).rglob("simulation.json")]
    print(json.dumps({"cell": only, "rc": rc, "wall_s": round(wall, 1), "simulation": sim, **counts}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
