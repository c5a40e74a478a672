"""In-process replicas sharing one rank table, for the weight and layer-level prefill tests.

    with weights_cluster(model, tmp_path, inactive=[1, 2]) as replicas:
        replicas[1].stub.RecvParams(...)

Each replica is what `serve()` runs (`replica.server.main.launch`): gRPC on 127.0.0.1 port 0, a
tcp fabric on loopback. `link_gbps` puts every rank on its own node with an emulated NIC of that
speed (paced transfers). Also: greedy generation over gRPC, transformers' reference, page checks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.config import ReplicaConfig
from replica.server.main import launch
from replica.server.weights_rpcs import WeightState
from tests.helpers.transfer_fabrics import free_ports

CALL_TIMEOUT = 60.0


@dataclass
class InProcReplica:
    """One replica of the group: its rank, stub and in-process services."""

    rank: int
    stub: pb_grpc.TextGenerationServiceStub
    channel: grpc.Channel
    services: Any

    @property
    def weights(self) -> WeightState:
        """The replica's parameter store, guard and zigzag queue (white-box checks)."""
        state = self.services.servicer.weights.state
        assert state is not None
        return state

    def free_blocks(self) -> int:
        """Info.num_blocks_free."""
        return int(self.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_blocks_free)

    def health(self) -> str:
        """Health.state."""
        return str(self.stub.Health(pb.HealthRequest(), timeout=CALL_TIMEOUT).state)


def write_rank_table(path: Path, n: int, link_gbps: float = 0.0) -> Path:
    """A rank table of `n` loopback ranks (each on its own node when links are emulated)."""
    ports = free_ports(n)
    ranks = [
        {
            "rank": r,
            "host": "127.0.0.1",
            "node": f"n{r}" if link_gbps else "n0",
            "device": "cpu",
            "transfer_address": f"127.0.0.1:{port}",
            "link_gbps": link_gbps,
        }
        for r, port in enumerate(ports)
    ]
    path.write_text(json.dumps({"ranks": ranks}))
    return path


@contextlib.contextmanager
def weights_cluster(
    model: Path, tmp_path: Path, n: int, inactive: Sequence[int] = (), link_gbps: float = 0.0, **config: Any
) -> Iterator[list[InProcReplica]]:
    """`n` replicas of `model` in this process; ranks in `inactive` start with nothing loaded."""
    table = write_rank_table(tmp_path / "ranks.json", n, link_gbps)
    replicas: list[InProcReplica] = []
    try:
        for rank in range(n):
            settings = {"num_blocks": 64, "block_size": 8, "transfer_timeout": 30.0, **config}
            cfg = ReplicaConfig(
                model=model, port=0, rank=rank, cluster=table, inactive=rank in inactive, **settings
            )
            services = launch(cfg)
            channel = grpc.insecure_channel(f"127.0.0.1:{services.port}")
            stub = pb_grpc.TextGenerationServiceStub(channel)
            replicas.append(InProcReplica(rank, stub, channel, services))
        yield replicas
    finally:
        for replica in replicas:
            replica.channel.close()
            replica.services.stop()


# ----------------------------------------------------------------------------- generation
def make_batch(batch_id: int, prompts: Sequence[Sequence[int]], max_new: int) -> pb.Batch:
    """A greedy batch (stops at EOS, like transformers), request ids batch_id*100 + i."""
    requests = [
        pb.Request(
            id=batch_id * 100 + i,
            input_tokens=list(p),
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new),
        )
        for i, p in enumerate(prompts)
    ]
    return pb.Batch(id=batch_id, requests=requests, size=len(requests))


def decode_to_end(
    stub: pb_grpc.TextGenerationServiceStub,
    batch: pb.CachedBatch | None,
    tokens: dict[int, list[int]],
    last: pb.Tokens | None = None,
) -> dict[int, list[int]]:
    """DecodeV2 until every request finished; `tokens` (request id → generated) is extended."""
    while batch is not None and batch.request_ids:
        request = pb.DecodeV2Request(batches=[batch], last_iter_tokens=[last or pb.Tokens()])
        last = None
        response = stub.DecodeV2(request, timeout=CALL_TIMEOUT)
        for gen in response.generations:
            tokens.setdefault(gen.request_id, []).extend(gen.tokens.ids)
        batch = response.batch if response.HasField("batch") else None
    return tokens


def generate(
    stub: pb_grpc.TextGenerationServiceStub, batch_id: int, prompts: Sequence[Sequence[int]], max_new: int
) -> list[list[int]]:
    """Greedy generation over gRPC: PrefillV2 NORMAL, then DecodeV2 to the end."""
    response = stub.PrefillV2(
        pb.PrefillV2Request(batch=make_batch(batch_id, prompts, max_new), forward_case=pb.NORMAL),
        timeout=CALL_TIMEOUT,
    )
    tokens = {gen.request_id: list(gen.tokens.ids) for gen in response.generations}
    decode_to_end(stub, response.batch if response.HasField("batch") else None, tokens)
    return [tokens[batch_id * 100 + i] for i in range(len(prompts))]


def prompts_for(vocab: int, count: int = 3, seed: int = 5) -> list[list[int]]:
    """A few prompts of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (4 + 5 * i,), generator=gen).tolist() for i in range(count)]


def reference(model: Path, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generation of each prompt (the oracle)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = hf.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out
