"""The soak's curves as one PNG: RSS, open fds, threads and free KV pages over time, one line per
process life, kills as dotted lines, the judged window (second half) shaded."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = [("rss_mib", "RSS (MiB)"), ("fds", "open file descriptors"), ("threads", "threads")]


def plot(report: dict[str, Any], path: Path) -> None:
    """Write the curves of `report` (bench.py's JSON) to `path`."""
    fig, axes = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    lives: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in report["samples"]["usage"]:
        lives[(row["process"], row["pid"])].append(row)
    colors: dict[str, str] = {}
    for ax, (metric, label) in zip(axes, PANELS, strict=False):
        for (name, _pid), rows in sorted(lives.items()):
            color = colors.setdefault(name, f"C{len(colors) % 10}")
            ax.plot([r["t"] / 60 for r in rows], [r[metric] for r in rows], color=color,
                    label=name if name not in ax.get_legend_handles_labels()[1] else None)
        ax.set_ylabel(label)
    pages: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in report["samples"]["pages"]:
        pages[row["replica"]].append(row)
    for name, rows in sorted(pages.items()):
        axes[3].plot([r["t"] / 60 for r in rows], [r["free"] for r in rows], marker=".", label=name)
    axes[3].set_ylabel("free KV pages")
    axes[3].set_xlabel("minutes")
    start, end = report["window_s"]
    for ax in axes:
        ax.axvspan(start / 60, end / 60, color="0.92", zorder=0)
        for kill in report["kills"]:
            ax.axvline(kill["killed_s"] / 60, color="red", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    axes[3].legend(fontsize=7)
    verdict = "PASS" if report["passed"] else "FAIL"
    axes[0].set_title(f"pdcluster bench soak, {report['minutes']:g} min: {verdict} "
                      "(shaded: the judged second half; red: replica kills)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
