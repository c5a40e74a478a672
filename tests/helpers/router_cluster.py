"""Helpers for the router's cluster tests: a transformers greedy oracle, replica probes, grpcurl."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from router.client import ReplicaClient
from router.tokenizer import Tokenizer
from router.types import ReplicaInfo

GRPCURL = str(Path(sys.executable).parent / "grpcurl")


class GreedyOracle:
    """transformers' greedy generation on the checkpoint, from the router's own tokenization."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    @functools.cache  # noqa: B019 - one oracle per test module, prompts repeat
    def ids(self, prompt: str, max_new: int) -> tuple[int, ...]:
        """Generated token ids (stops at EOS like the replica)."""
        inp = self.torch.tensor([self.tokenizer.encode(prompt)])
        with self.torch.no_grad():
            out = self.model.generate(inp, attention_mask=self.torch.ones_like(inp), max_new_tokens=max_new,
                                      do_sample=False, pad_token_id=0)
        return tuple(int(t) for t in out[0, inp.shape[1]:])

    def text(self, prompt: str, max_new: int) -> str:
        """The generated text."""
        return self.tokenizer.decode(list(self.ids(prompt, max_new)))


def replica_infos(addresses: list[str]) -> list[ReplicaInfo]:
    """Info of every replica (fresh channels)."""
    async def probe() -> list[ReplicaInfo]:
        clients = [ReplicaClient(a, timeout=10) for a in addresses]
        try:
            return list(await asyncio.gather(*(c.info() for c in clients)))
        finally:
            for c in clients:
                await c.close()
    return asyncio.run(probe())


def wait_pages_free(addresses: list[str], timeout: float = 30.0) -> list[ReplicaInfo]:
    """Poll until every replica has all its pages free (returns the last Infos either way)."""
    end = time.monotonic() + timeout
    while True:
        infos = replica_infos(addresses)
        if all(i.num_blocks_free == i.num_blocks_total for i in infos) or time.monotonic() > end:
            return infos
        time.sleep(0.2)


def grpcurl(admin: str, method: str, data: dict[str, Any] | None = None, token: str = "") -> dict[str, Any]:
    """Call the router's admin service with grpcurl (reflection); returns the JSON answer."""
    cmd = [GRPCURL, "-plaintext", "-max-time", "30"]
    if token:
        cmd += ["-H", f"x-admin-token: {token}"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [admin, f"router.v1.RouterAdmin/{method}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"grpcurl {method} failed: {done.stderr.strip()}")
    return json.loads(done.stdout or "{}")
