"""`pdcluster bench gpu`: the engine's decode and prefill on one device, against that device's own
limits measured in the same run.

```
 limits:  device-to-device copy_ (bytes read + written / s)      bf16 matmul n^3 (FLOP/s)
 model:   Llama-2-7B shape, random weights made in device memory (or --model DIR)
 decode:  per context: one cache sized for the largest batch that fits, filled with random K/V,
          graphs captured; per batch: steps through ModelRunner.forward (graphs, then eager)
          ratio = step time / ((weight bytes + KV bytes read) / copy bandwidth)   (1.0 = roofline)
 prefill: one fresh prompt per length; ratio = achieved FLOP/s / matmul FLOP/s (1.0 = matmul rate)
```

Cells whose pages do not fit in the device's free memory are skipped, each with the arithmetic.
Goals (recorded, not asserted): batch-1 decode <= 1.25x roofline, batch-64 decode at 1 k context
<= 1.5x, prefill at 2 k tokens >= 0.6 of the matmul rate. The formulas are in the JSON
(`gpu_roofline.py`). With `--profile` the top ops of batch-1 decode steps go into the JSON too.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from typing import Any

from pdcluster.bench import gpu_roofline as rl
from pdcluster.bench.gpu_config import BenchGpuConfig


def goals(decode: list[dict[str, Any]], prefill: list[dict[str, Any]], contexts: list[int]) -> dict[str, Any]:
    """The issue's goals from the measured rows (the graphs path where it ran, else eager)."""
    def decode_ratio(batch: int, context: int) -> tuple[float | None, str]:
        row = next((r for r in decode if r["batch"] == batch and r["context"] == context), None)
        if row is None or row["status"] != "measured":
            return None, ""
        path = "graphs" if row["graphs"] is not None else "eager"
        return row[path]["ratio"], path

    out: dict[str, Any] = {}
    for context in contexts:
        value, path = decode_ratio(1, context)
        out[f"decode_batch1_ctx{context}"] = {**rl.Goal(value, rl.DECODE_B1_GOAL, True).to_json(),
                                               "path": path}
    value, path = decode_ratio(64, 1024)
    out["decode_batch64_ctx1024"] = {**rl.Goal(value, rl.DECODE_B64_1K_GOAL, True).to_json(),
                                     "path": path}
    row = next((r for r in prefill if r["tokens"] == 2048 and r["status"] == "measured"), None)
    out["prefill_2048"] = rl.Goal(None if row is None else row["ratio"], rl.PREFILL_2K_GOAL, False).to_json()
    return out


def _print_summary(report: dict[str, Any]) -> None:
    limits = report["limits"]
    print(f"device {report['device']['name']}: copy {limits['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"matmul {limits['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({report['config']['dtype']})")
    print(f"{'context':>8} {'batch':>6} {'roofline ms':>12} {'graphs ms':>10} {'ratio':>6} {'eager ms':>9} "
          f"{'ratio':>6}")
    for r in report["decode"]:
        if r["status"] != "measured":
            print(f"{r['context']:>8} {r['batch']:>6}  skipped: {r['reason']}")
            continue
        g = r["graphs"]
        gms, gratio = (f"{'-':>10}", f"{'-':>6}")
        if g is not None:
            gms, gratio = f"{g['best_s'] * 1e3:10.3f}", f"{g['ratio']:6.2f}"
        e = r["eager"]
        print(f"{r['context']:>8} {r['batch']:>6} {r['roofline_s'] * 1e3:12.3f} {gms} {gratio} "
              f"{e['best_s'] * 1e3:9.3f} {e['ratio']:6.2f}")
    print(f"{'prefill':>8} {'tok/s':>10} {'TFLOP/s':>8} {'ratio':>6}")
    for r in report["prefill"]:
        if r["status"] != "measured":
            print(f"{r['tokens']:>8}  skipped: {r['reason']}")
            continue
        print(f"{r['tokens']:>8} {r['tokens_per_s']:10.0f} {r['flops_per_s'] / 1e12:8.2f} {r['ratio']:6.2f}")
    for name, goal in report["goals"].items():
        value = "-" if goal["value"] is None else f"{goal['value']:.2f}"
        print(f"goal {name}: {value} {goal['op']} {goal['limit']}: {goal['verdict']}")


def run(config: BenchGpuConfig) -> int:
    """Measure the limits, decode and prefill; print, and write the JSON and the PNG."""
    from pdcluster.bench.gpu_run import measure

    report = measure(config)
    report["goals"] = goals(report["decode"], report["prefill"], config.context_lengths)
    report["config"] = {**asdict(config), "model": None if config.model is None else str(config.model),
                        "json": None if config.json is None else str(config.json),
                        "plot": None if config.plot_path is None else str(config.plot_path)}
    report["host"] = {"python": platform.python_version()}
    _print_summary(report)
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {config.json}")
    plot = config.plot_path
    if plot is not None:
        from pdcluster.bench.gpu_plot import write_plot

        write_plot(report, plot)
        print(f"wrote {plot}")
    return 0
