"""Running `tests.helpers.tp_greedy` (rank 0 of a TP group) and transformers' greedy reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

PROMPT = [5, 17, 42, 99, 7, 250, 3]
STEPS = 8
ROOT = Path(__file__).resolve().parents[2]


def run_leader(model: Path, world: int, *extra: str) -> dict[str, object]:
    """The helper's JSON line (its last line of output)."""
    command = [sys.executable, "-m", "tests.helpers.tp_greedy", str(model), str(world), str(STEPS),
               *map(str, PROMPT), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def reference_tokens(model: Path) -> list[int]:
    """transformers' greedy tokens (float32, on the CPU)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
    return [int(t) for t in out[0, len(PROMPT):]]
