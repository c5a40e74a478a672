"""`pdcluster demo` (what `make demo` runs): a tiny model, a 1 prefill + 1 decode cluster, a few
streaming requests through the OpenAI API with each answer's route, then a clean shutdown.

The model is trained for a few hundred steps on the built-in English text (pdcluster/tools/tiny_train.py,
under a minute on 2 cores, once per workdir), so each prompt, taken from that text, is answered with
the words that follow it there.

If a KV migration fails, the router falls back to recomputing on the decode replica (it never fails
a request for it); the demo reads the strategy each request really took from its route and says so.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.local import LocalCluster, UpConfig
from router.config import Strategy

PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "The prefill replica reads",
)
TRAIN_STEPS = 300
TRAIN_SECONDS = 45.0  # cap: training never holds the demo up for more than this


@dataclass
class DemoConfig:
    """Flags of `pdcluster demo`."""

    workdir: Path = field(default=Path(".demo"), metadata={"help": "folder for the model and the logs"})
    strategy: Strategy = field(default=Strategy.FULL, metadata={"help": "migration strategy asked for"})
    max_tokens: int = field(default=24, metadata={"help": "tokens generated per request"})

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        if isinstance(self.strategy, str):
            self.strategy = Strategy(self.strategy)


def ensure_model(workdir: Path) -> Path:
    """The trained tiny checkpoint under `workdir/model`, built once per workdir.

    `workdir/model.json` records the settings the folder was built with, so a folder left by an
    older demo (e.g. random weights) or one whose build was interrupted is built again.
    """
    from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

    out = workdir / "model"
    # a little larger than the tests' default checkpoint, so it learns the text in the time given
    config = TinyModelConfig(out=out, layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256,
                             train_steps=TRAIN_STEPS, train_seconds=TRAIN_SECONDS)
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "out"}
    stamp = workdir / "model.json"
    if (out / "config.json").exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return out
    print(f"training a tiny model on the built-in corpus for {TRAIN_STEPS} steps "
          f"(at most {TRAIN_SECONDS:.0f} s) in {out} ...", flush=True)
    stamp.unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    make_tiny_model(config, log=lambda line: print(line, flush=True))
    stamp.write_text(json.dumps(settings, indent=2) + "\n")
    return out


def stream_one(client: Any, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any], float]:
    """One streaming completion; returns its text, its route and its seconds."""
    t0 = time.monotonic()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    parts: list[str] = []
    route: dict[str, Any] = {}
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text or "")
        extra = chunk.model_extra or {}
        route = extra.get("pdcluster_route") or route
    return "".join(parts), route, time.monotonic() - t0


def describe(route: dict[str, Any]) -> str:
    """The route as one line."""
    nbytes = int(route.get("migration_bytes", 0))
    size = f"{nbytes / 1024:.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"
    ms = route.get("migration_seconds", 0.0) * 1000
    return (f"prefill replica {route.get('prefill_replica')} -> [{route.get('strategy')}: {size} "
            f"in {ms:.1f} ms] -> decode replica {route.get('decode_replica')}")


def run(config: DemoConfig) -> int:
    """Entry point of `pdcluster demo`."""
    import openai

    model_dir = ensure_model(config.workdir)
    up = UpConfig(model=model_dir, prefill=1, decode=1, strategy=config.strategy.value, http_port=0,
                  admin_port=0, num_blocks=256, log_dir=config.workdir / "logs")
    print(f"starting 1 prefill + 1 decode replica and the router (strategy {config.strategy.value}) ...",
          flush=True)
    with LocalCluster(up) as cluster:
        print(cluster.ready_line(), flush=True)
        client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="demo", timeout=120)
        taken: set[str] = set()
        for prompt in PROMPTS:
            text, route, seconds = stream_one(client, model_dir.name, prompt, config.max_tokens)
            taken.add(str(route.get("strategy")))
            print(f"\n> {prompt}\n{text!r}\n  route: {describe(route)}  ({seconds * 1000:.0f} ms)",
                  flush=True)
        if taken != {config.strategy.value}:
            print(f"\nnote: asked for '{config.strategy.value}' but the requests went by {sorted(taken)}: "
                  f"a migration failed and the router fell back (replica logs: {config.workdir / 'logs'}).",
                  flush=True)
        print("\nstopping the cluster ...", flush=True)
    print("demo done: every process stopped.", flush=True)
    return 0
