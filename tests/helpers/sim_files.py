"""Pieces of experiment files for the simulator's tests: the simulated Llama-2-7B on A100s and its
SLOs, and topologies of nodes on 100 Gbit/s NICs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def simulated_model(tokenizer: Path) -> str:
    """The `[model]` (a simulated Llama-2-7B on A100s; `tokenizer`'s texts) and `[slo]` tables."""
    return f"""[model]
path = "{tokenizer}"
engine = "simulated"
gpu = "a100-80g"
model_card = "llama-2-7b"
[slo]
ttft_ms = 1000
tpot_ms = 100
"""


def topology(name: str, nodes: Sequence[tuple[str, int, Sequence[str]]]) -> str:
    """A `[[topologies]]` entry: each node (name, replicas, models its host memory holds at start)
    on a 100 Gbit/s NIC."""
    text = f'[[topologies]]\nname = "{name}"\n'
    for node, replicas, held in nodes:
        text += f'[[topologies.nodes]]\nname = "{node}"\nreplicas = {replicas}\nnic_gbps = 100.0\n'
        if held:
            text += "host_models = [" + ", ".join(f'"{m}"' for m in held) + "]\n"
    return text
