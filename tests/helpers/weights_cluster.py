"""In-process replicas sharing one rank table, for the weight and layer-level prefill tests.

    with weights_cluster(model, tmp_path, inactive=[1, 2]) as replicas:
        replicas[1].stub.RecvParams(...)

The replicas come from `tests.helpers.inproc_cluster` (what `serve()` runs, in this process;
`link_gbps` emulates a NIC per rank). Also: greedy generation over gRPC, transformers' reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.engine_driver import reference_greedy
from tests.helpers.inproc_cluster import CALL_TIMEOUT as CALL_TIMEOUT
from tests.helpers.inproc_cluster import InProcReplica as InProcReplica
from tests.helpers.inproc_cluster import inproc_cluster
from tests.helpers.inproc_cluster import write_rank_table as write_rank_table


@contextlib.contextmanager
def weights_cluster(
    model: Path, tmp_path: Path, n: int, inactive: Sequence[int] = (), link_gbps: float = 0.0, **config: Any
) -> Iterator[list[InProcReplica]]:
    """`n` replicas of `model` in this process; ranks in `inactive` start with nothing loaded."""
    settings = {"num_blocks": 64, "block_size": 8, "transfer_timeout": 30.0, **config}

    def config_for(rank: int) -> dict[str, Any]:
        return {**settings, "inactive": rank in inactive}

    with inproc_cluster(model, tmp_path, n, config_for, link_gbps) as replicas:
        yield replicas


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
    return [reference_greedy(hf, p, max_new)[0] for p in prompts]
