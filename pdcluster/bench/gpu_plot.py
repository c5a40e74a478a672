"""The PNG of `pdcluster bench gpu` (matplotlib's Agg backend, no display): left, decode step time
over its roofline against the batch size, one line per context and path (graphs solid, eager dashed);
right, prefill FLOP/s over the measured matmul rate against the prompt length. Goals are dotted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; must precede pyplot's import
import matplotlib.pyplot as plt

from pdcluster.bench import gpu_roofline as rl


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Draw the report's decode and prefill ratios into `path`."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    decode = [r for r in report["decode"] if r["status"] == "measured"]
    for context in sorted({r["context"] for r in decode}):
        rows = sorted((r for r in decode if r["context"] == context), key=lambda r: r["batch"])
        for path_name, style in (("graphs", "-o"), ("eager", "--s")):
            points = [(r["batch"], r[path_name]["ratio"]) for r in rows if r[path_name] is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                left.plot(xs, ys, style, label=f"context {context}, {path_name}")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.axhline(rl.DECODE_B1_GOAL, color="green", linestyle=":", label=f"goal batch 1 ({rl.DECODE_B1_GOAL})")
    left.axhline(rl.DECODE_B64_1K_GOAL, color="orange", linestyle=":",
                 label=f"goal batch 64, 1 k ({rl.DECODE_B64_1K_GOAL})")
    left.set_xscale("log", base=2)
    left.set_xlabel("decode batch")
    left.set_ylabel("step time / roofline time")
    left.set_title("decode (1.0 = weights + KV at copy bandwidth)")
    left.legend(fontsize=7)
    prefill = [r for r in report["prefill"] if r["status"] == "measured"]
    if prefill:
        right.plot([r["tokens"] for r in prefill], [r["ratio"] for r in prefill], "-o", label="prefill")
    right.axhline(rl.PREFILL_2K_GOAL, color="green", linestyle=":",
                  label=f"goal at 2 k ({rl.PREFILL_2K_GOAL})")
    right.set_xscale("log", base=2)
    right.set_xlabel("prompt tokens")
    right.set_ylabel("FLOP/s / matmul FLOP/s")
    right.set_title("prefill (1.0 = measured matmul rate)")
    right.legend(fontsize=7)
    fig.suptitle(f"{report['device']['name']}, {report['model']['source']}, "
                 f"{report['limits']['matmul_dtype']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
