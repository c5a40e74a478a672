"""The fake replica answers like a real one: one script of calls (tests/helpers/replica_script.py)
against three fake replicas and against three real ones in this process, same observable results."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc.aio

from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.fake_replica import FakeFabric, FakeReplica
from tests.helpers.inproc_cluster import inproc_cluster
from tests.helpers.replica_script import Step, run_script

NUM_BLOCKS = 48


async def over_channels(addresses: list[str], model_name: str) -> list[Step]:
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        return await run_script([pb_grpc.TextGenerationServiceStub(c) for c in channels], model_name)
    finally:
        for channel in channels:
            await channel.close()


async def fake_transcript(model_name: str) -> list[Step]:
    fabric = FakeFabric()
    fakes = [FakeReplica(rank, fabric, num_blocks=NUM_BLOCKS, loaded=rank != 2) for rank in range(3)]
    try:
        return await over_channels([await f.start() for f in fakes], model_name)
    finally:
        for fake in fakes:
            await fake.stop()


def real_transcript(model: Path, tmp_path: Path) -> list[Step]:
    def config(rank: int) -> dict[str, object]:
        return {"num_blocks": NUM_BLOCKS, "inactive": rank == 2}

    with inproc_cluster(model, tmp_path, 3, config) as replicas:
        addresses = [f"127.0.0.1:{r.services.port}" for r in replicas]
        return asyncio.run(asyncio.wait_for(over_channels(addresses, model.name), 60))


def test_the_fake_replica_answers_the_script_like_a_real_one(tiny_llama: Path, tmp_path: Path) -> None:
    real = real_transcript(tiny_llama, tmp_path)
    fake = asyncio.run(asyncio.wait_for(fake_transcript(tiny_llama.name), 60))
    assert [name for name, _ in fake] == [name for name, _ in real]
    for (name, want), (_, got) in zip(real, fake, strict=True):
        assert got == want, f"{name}: the fake answered {got!r}, a real replica {want!r}"
