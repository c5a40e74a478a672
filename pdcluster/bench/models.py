"""The checkpoint a CPU benchmark runs on when it is given none: PEERS.md's 54 M Llama (or, with
`quick`, the default tiny one), built into a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BIG_MODEL = {"layers": 8, "hidden": 768, "heads": 12, "kv_heads": 4, "intermediate": 2048, "vocab": 4096}
"""The 54 M-parameter Llama of PEERS.md (`pdcluster make-tiny-model` flags)."""


def model_or_built(model: Path | None, quick: bool, tmp: Path) -> tuple[Path, str]:
    """`model` itself, or a random-weight checkpoint built under `tmp`; (folder, its name in reports)."""
    if model is not None:
        return model, str(model)
    from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

    shape: dict[str, Any] = {} if quick else BIG_MODEL
    name = "tiny llama (2 layers)" if quick else "54 M llama " + json.dumps(shape)
    return make_tiny_model(TinyModelConfig(out=tmp / "model", arch="llama", **shape)), name
