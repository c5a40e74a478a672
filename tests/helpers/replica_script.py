"""One script of `generate.v2` calls and the observable results it records, for the fake replica's
conformance test (tests/component/router/test_fake_replica_conformance.py).

    transcript = await run_script(stubs)   # stubs of ranks 0 and 1 (loaded) and 2 (inactive)

Every step records its name and either the status code it failed with or its answer with what
depends on the model left out (token ids, texts, logprobs): batch ids, request ids, sizes, page
counts, generation counts, finish reasons, readiness, `Info`'s page accounting. Run against the
fake and against real replicas, the transcripts must be equal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc

Stub = pb_grpc.TextGenerationServiceStub
Step = tuple[str, Any]


def request(rid: int, prompt: Sequence[int], max_new: int) -> pb.Request:
    """A greedy request that ignores EOS (the fake's and the real model's EOS differ)."""
    stopping = pb.StoppingCriteriaParameters(max_new_tokens=max_new, ignore_eos_token=True)
    return pb.Request(id=rid, input_tokens=list(prompt), stopping_parameters=stopping)


def batch(bid: int, *requests: pb.Request) -> pb.Batch:
    """A batch of `requests`."""
    return pb.Batch(id=bid, requests=list(requests), size=len(requests))


def cached(msg: pb.CachedBatch) -> tuple[int, tuple[int, ...], int, int]:
    """A cached batch as (id, request ids, size, max_tokens)."""
    return msg.id, tuple(msg.request_ids), msg.size, msg.max_tokens


def step_result(resp: Any) -> dict[str, Any]:
    """Generations (per request: tokens, finish) and the cached batch of a Prefill/Decode answer."""
    gens = []
    for g in sorted(resp.generations, key=lambda g: g.request_id):
        done = g.generated_text if g.HasField("generated_text") else None
        finish = None if done is None else (pb.FinishReason.Name(done.finish_reason), done.generated_tokens)
        gens.append((g.request_id, len(g.tokens.ids), finish))
    return {"generations": gens, "batch": cached(resp.batch) if resp.HasField("batch") else None}


def info(resp: pb.InfoResponse) -> dict[str, Any]:
    """Info without the model's name and type."""
    keep = ("num_layers", "block_size", "num_blocks_total", "num_blocks_free", "embed_ready",
            "num_layers_loaded", "lm_head_ready", "rank", "tp_size", "num_cached_batches",
            "max_input_tokens", "max_total_tokens")
    return {k: getattr(resp, k) for k in keep}


async def outcome(send: Awaitable[Any], show: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(answer, what it shows), or (None, the status code's name) when the call failed."""
    try:
        answer = await send
    except grpc.aio.AioRpcError as exc:
        return None, exc.code().name
    return answer, show(answer)


class Recorder:
    """Runs calls and keeps what they showed."""

    def __init__(self, stubs: Sequence[Stub]) -> None:
        self.stubs = stubs
        self.steps: list[Step] = []

    async def call(self, name: str, send: Awaitable[Any], show: Callable[[Any], Any] = lambda _: "ok") -> Any:
        """Await `send`; record `show(answer)` or the status code it failed with."""
        answer, shown = await outcome(send, show)
        self.steps.append((name, shown))
        return answer

    async def pair(self, first: tuple[str, Awaitable[Any]], second: tuple[str, Awaitable[Any]],
                   show: Callable[[Any], Any]) -> None:
        """Two calls at once (a sender and its receiver), recorded in this order."""
        both = await asyncio.gather(outcome(first[1], show), outcome(second[1], show))
        self.steps += [(first[0], both[0][1]), (second[0], both[1][1])]

    async def info(self, rank: int) -> None:
        """Record rank's Info."""
        await self.call(f"Info {rank}", self.stubs[rank].Info(pb.InfoRequest()), info)

    async def health(self, rank: int) -> None:
        """Record rank's Health."""
        await self.call(f"Health {rank}", self.stubs[rank].Health(pb.HealthRequest()), lambda r: r.state)


async def run_script(stubs: Sequence[Stub], model_name: str) -> list[Step]:
    """The script: batches on rank 0, a migration 0 → 1, parameter operations with rank 2
    (`model_name`: the checkpoint's folder under the model root, for LoadParams)."""
    rec = Recorder(stubs)
    for rank in range(3):
        await rec.info(rank)
        await rec.health(rank)
    await batches(rec)
    await refusals(rec)
    await migration(rec)
    await parameters(rec, model_name)
    return rec.steps


async def batches(rec: Recorder) -> None:
    """Prefill, decode to a finish, filter, clear; pages after each."""
    s = rec.stubs[0]
    b1 = batch(1, request(10, [5, 6, 7, 8, 9], 3), request(11, [4] * 20, 6))
    first = await rec.call("PrefillV2 b1", s.PrefillV2(pb.PrefillV2Request(batch=b1)), step_result)
    await rec.info(0)
    live = first.batch
    for i in range(3):
        answer = await rec.call(f"DecodeV2 b1 #{i}", s.DecodeV2(pb.DecodeV2Request(batches=[live])),
                                step_result)
        live = answer.batch if answer is not None else live
    await rec.info(0)  # request 10 finished: its pages stay until FilterBatch
    keep_11 = pb.FilterBatchRequest(batch_id=1, request_ids=[11])
    await rec.call("FilterBatch b1 keep 11", s.FilterBatch(keep_11), lambda r: cached(r.batch))
    await rec.info(0)
    await rec.call("FilterBatch b1 keep 12 (not in it)",
                   s.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[12])))
    b6 = batch(6, request(60, [8, 8], 2))
    await rec.call("PrefillV2 b6", s.PrefillV2(pb.PrefillV2Request(batch=b6)), step_result)
    await rec.call("FilterBatch b6 keep none", s.FilterBatch(pb.FilterBatchRequest(batch_id=6)),
                   lambda r: cached(r.batch) if r.HasField("batch") else None)
    await rec.info(0)
    await rec.call("FilterBatch b9", s.FilterBatch(pb.FilterBatchRequest(batch_id=9, request_ids=[1])))
    await rec.call("DecodeV2 b9", s.DecodeV2(pb.DecodeV2Request(batches=[pb.CachedBatch(id=9)])))
    b2 = batch(2, request(20, [3, 3, 3], 1))
    await rec.call("PrefillV2 b2 (all finish)", s.PrefillV2(pb.PrefillV2Request(batch=b2)), step_result)
    await rec.info(0)
    await rec.call("ClearCache b1", s.ClearCache(pb.ClearCacheRequest(id=1)))
    await rec.call("ClearCache b1 again", s.ClearCache(pb.ClearCacheRequest(id=1)))
    for bid, prompt in ((3, [7]), (4, [7] * 12)):  # b4: 12 + 4 tokens fill one page exactly
        one = pb.PrefillV2Request(batch=batch(bid, request(bid, prompt, 4)))
        await rec.call(f"PrefillV2 b{bid}", s.PrefillV2(one), step_result)
    await rec.info(0)
    await rec.call("ClearCache all", s.ClearCache(pb.ClearCacheRequest()))
    await rec.info(0)


async def refusals(rec: Recorder) -> None:
    """What a replica refuses, and that a refusal leaves its pages as they were."""
    s = rec.stubs[0]
    await rec.call("PrefillV2 b5", s.PrefillV2(pb.PrefillV2Request(batch=batch(5, request(50, [9, 9], 4)))),
                   step_result)
    refused = {
        "same batch id": batch(5, request(51, [9], 2)),
        "same request id twice": batch(6, request(60, [9], 2), request(60, [8], 2)),
        "request id of a cached batch": batch(6, request(50, [9], 2)),
        # distinct prompts: identical ones would share their full pages (prefix cache) and fit
        "more pages than free": batch(6, request(60, [9] * 300, 200), request(61, [8] * 300, 200)),
        "prompt over max_input_tokens": batch(6, request(60, [9] * 600, 1)),
        "prompt + max_new over max_total_tokens": batch(6, request(60, [9] * 10, 600)),
        "empty prompt": batch(6, request(60, [], 2)),
        "max_new_tokens 0": batch(6, request(60, [9], 0)),
        "token outside the vocabulary": batch(6, request(60, [10**6], 2)),
        "no requests": batch(6),
    }
    for what, bad in refused.items():
        await rec.call(f"PrefillV2 {what}", s.PrefillV2(pb.PrefillV2Request(batch=bad)), step_result)
    await rec.info(0)
    await rec.call("ClearCache all", s.ClearCache(pb.ClearCacheRequest()))


async def migration(rec: Recorder) -> None:
    """Migrate 0 → 1 ‖ Immigrate on 1; rank 1 decodes the batch, appending the first tokens."""
    p, d = rec.stubs[0], rec.stubs[1]
    b7 = batch(7, request(70, [1, 2, 3, 4], 1), request(71, [6] * 17, 3))  # 70 ends at its first token
    first = await rec.call("PrefillV2 b7", p.PrefillV2(pb.PrefillV2Request(batch=b7)), step_result)
    tokens = {g.request_id: list(g.tokens.ids) for g in first.generations}
    await rec.pair(("Migrate b7 0→1", p.Migrate(pb.MigrateRequest(batch=b7, src=[0], dst=[1]))),
                   ("Immigrate b7 0→1", d.Immigrate(pb.ImmigrateRequest(batch=b7, src=[0], dst=[1]))),
                   lambda r: cached(r.batch))
    await rec.info(0)
    await rec.info(1)
    await rec.call("Migrate b8 (unknown)", p.Migrate(pb.MigrateRequest(batch=batch(8, request(80, [1], 1)),
                                                                        src=[0], dst=[1])))
    last = [pb.Tokens(ids=tokens[70] + tokens[71] + tokens[71])]
    live = pb.CachedBatch(id=7, request_ids=[70, 71], size=2, max_tokens=0)
    await rec.call("DecodeV2 b7 wrong last tokens",
                   d.DecodeV2(pb.DecodeV2Request(batches=[live], last_iter_tokens=last)), step_result)
    last = [pb.Tokens(ids=[tokens[70][0], tokens[71][0]])]
    with_first = pb.DecodeV2Request(batches=[live], last_iter_tokens=last)
    answer = await rec.call("DecodeV2 b7 with first tokens", d.DecodeV2(with_first), step_result)
    if answer is not None:  # (else the transcripts differ already)
        await rec.call("DecodeV2 b7", d.DecodeV2(pb.DecodeV2Request(batches=[answer.batch])), step_result)
    await rec.info(1)
    b8 = batch(8, request(80, [2, 7], 2))
    progressive = pb.PrefillV2Request(batch=b8, forward_case=pb.MIGRATE_PROGRESSIVE, pipe_peer=[1])
    await rec.pair(("PrefillV2 b8 MIGRATE_PROGRESSIVE to 1", p.PrefillV2(progressive)),
                   ("Immigrate b8 0→1", d.Immigrate(pb.ImmigrateRequest(batch=b8, src=[0], dst=[1]))),
                   lambda r: step_result(r) if hasattr(r, "generations") else cached(r.batch))
    await rec.info(0)
    await rec.info(1)
    await rec.call("ClearCache all on 1", d.ClearCache(pb.ClearCacheRequest()))


async def parameters(rec: Recorder, model_name: str) -> None:
    """Weights to the inactive rank 2 by p2p and chain; the one-operation guard; load and reset."""
    src, dst = rec.stubs[0], rec.stubs[2]
    one = batch(9, request(90, [5], 1))
    await rec.call("PrefillV2 on inactive", dst.PrefillV2(pb.PrefillV2Request(batch=one)), step_result)
    await rec.call("WaitRdmaDone with nothing in flight", dst.WaitRdmaDone(pb.WaitRdmaDoneRequest()))
    await rec.call("LoadParams HOST without a copy",
                   dst.LoadParams(pb.LoadParamsRequest(load_case=pb.LOAD_FROM_HOST_MEM)))
    await rec.call("SendParams from inactive", dst.SendParams(pb.SendParamsRequest(dst=0)))
    await rec.call("SendParams 0→2", src.SendParams(pb.SendParamsRequest(dst=2)))
    await rec.call("RecvParams 2←0", dst.RecvParams(pb.RecvParamsRequest(src=0)))
    await rec.call("SendParams 0→2 again before the join", src.SendParams(pb.SendParamsRequest(dst=2)))
    await rec.call("ResetStatus 0 before the join", src.ResetStatus(pb.ResetStatusRequest()))
    await rec.call("WaitRdmaDone 0", src.WaitRdmaDone(pb.WaitRdmaDoneRequest()))
    await rec.call("WaitRdmaDone 2", dst.WaitRdmaDone(pb.WaitRdmaDoneRequest()))
    await rec.health(2)
    await rec.info(2)
    await rec.call("RecvParams into a complete buffer", dst.RecvParams(pb.RecvParamsRequest(src=0)))
    disk = pb.LoadParamsRequest(load_case=pb.LOAD_FROM_DISK, model_name=model_name)
    await rec.call("LoadParams DISK into a complete buffer", dst.LoadParams(disk))
    await rec.call("ResetStatus 2", dst.ResetStatus(pb.ResetStatusRequest()))
    await rec.call("LoadParams DISK without a name",
                   dst.LoadParams(pb.LoadParamsRequest(load_case=pb.LOAD_FROM_DISK)))
    await rec.call("LoadParams DISK", dst.LoadParams(disk))
    await rec.health(2)
    await rec.call("ResetStatus 2 after the load", dst.ResetStatus(pb.ResetStatusRequest()))
    await rec.health(2)
    await rec.call("LoadParams HOST after a reset",
                   dst.LoadParams(pb.LoadParamsRequest(load_case=pb.LOAD_FROM_HOST_MEM)))
    await rec.health(2)
    await rec.call("ResetStatus 2 again", dst.ResetStatus(pb.ResetStatusRequest()))
    chain = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[2])
    await rec.call("RdmaBroadcast 0", src.RdmaBroadcast(chain))
    await rec.call("RdmaBroadcast 2", dst.RdmaBroadcast(chain))
    await rec.call("WaitRdmaDone 0", src.WaitRdmaDone(pb.WaitRdmaDoneRequest()))
    await rec.call("WaitRdmaDone 2", dst.WaitRdmaDone(pb.WaitRdmaDoneRequest()))
    await rec.health(2)
    await rec.call("ResetStatus 2 after the chain", dst.ResetStatus(pb.ResetStatusRequest()))
    uneven = pb.BroadcastRequest(src_ranks=[0, 1], dst_ranks=[2])
    await rec.call("TanzBroadcast with 2 sources for 1 destination", dst.TanzBroadcast(uneven))
    await rec.call("RdmaBroadcast 1 not a member", rec.stubs[1].RdmaBroadcast(chain))
    tanz = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[2])
    await rec.pair(("TanzBroadcast 0", src.TanzBroadcast(tanz)), ("TanzBroadcast 2", dst.TanzBroadcast(tanz)),
                   lambda _: "ok")
    await rec.call("WaitRdmaDone after Tanz (blocking)", dst.WaitRdmaDone(pb.WaitRdmaDoneRequest()))
    await rec.health(2)
    await rec.call("PrefillV2 after the chain", dst.PrefillV2(pb.PrefillV2Request(batch=one)), step_result)
    await rec.info(2)
