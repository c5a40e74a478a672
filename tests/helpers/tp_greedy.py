"""`python -m tests.helpers.tp_greedy MODEL WORLD STEPS PROMPT_IDS...`: greedy tokens from a TP group.

Rank 0 runs here (it starts the other ranks as processes), feeds the prompt as two resumed chunks
over scattered pages, then decodes `STEPS` tokens one forward at a time and prints them as JSON.
Before decoding it sends one step every rank refuses (a page past the cache): the group must go on.
With `--kill-rank R` it kills worker R before the first decode step and prints the error instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from replica.engine.backend import SeqInput
from replica.errors import InvalidArgument
from replica.tp.leader import start_group
from replica.tp.rank import RankSpec
from replica.tp.runner import TpRunner

BLOCK_SIZE = 4


def _refused_step(runner: TpRunner) -> str:
    """A step every rank refuses (a page past the cache) before any collective: the group goes on."""
    try:
        runner.forward([SeqInput([7], [999], 0)])
    except InvalidArgument as error:
        return type(error).__name__
    return "accepted"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("world", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("prompt", type=int, nargs="+")
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--device", default="cpu", help="rank 0's device (cuda: rank r on cuda:r, NCCL)")
    args = parser.parse_args()
    spec = RankSpec(args.model, torch.float32, num_blocks=32, block_size=BLOCK_SIZE)
    leader = start_group(spec, args.world, torch.device(args.device), args.timeout)
    pages = [9, 3, 17, 5, 30, 1, 12, 8]  # scattered on purpose
    tokens = list(args.prompt)
    half = len(tokens) // 2
    try:
        leader.runner.forward([SeqInput(tokens[:half], pages, 0)])
        out = leader.runner.forward([SeqInput(tokens[half:], pages, half)])
        refused = _refused_step(leader.runner)
        if args.kill_rank:
            leader.workers[args.kill_rank - 1].kill()
        for _ in range(args.steps):
            tokens.append(int(out.last_logits[0].argmax()))
            out = leader.runner.forward([SeqInput(tokens[-1:], pages, len(tokens) - 1)])
    except Exception as error:  # the test reads which error it was
        print(json.dumps({"error": type(error).__name__, "message": str(error)}), flush=True)
        leader.stop()
        return
    leader.stop()
    print(json.dumps({"tokens": tokens[len(args.prompt):], "refused": refused}), flush=True)


if __name__ == "__main__":
    main()
