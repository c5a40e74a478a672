"""Staged tcp on a real GPU: CUDA tensors move between fabrics of one process over tcp through pinned
host slots, p2p with scattered pages and down a chain, and a send posted while the kernel that
writes its bytes is still running delivers that kernel's result. Skips without CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest
import torch

from tests.helpers.transfer_fabrics import local_table, run_all
from transfer.collectives import TransferOptions, chain_broadcast, recv_regions, send_regions
from transfer.core import Deadline, Stream
from transfer.fabric import Fabric
from transfer.staged import StagedFabric
from transfer.tcp.fabric import TcpFabric

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OPTIONS = TransferOptions(chunk_bytes=4 << 20, window=8)


@pytest.fixture
def fabrics() -> Iterator[list[Fabric]]:
    table = local_table(3)
    made: list[Fabric] = [StagedFabric(TcpFabric(table, r)) for r in range(3)]
    yield made
    for fabric in made:
        fabric.close()


def _ok(errors: list[BaseException | None]) -> None:
    failures = [e for e in errors if e is not None]
    assert not failures, failures


def test_scattered_pages_of_a_cuda_tensor_move_p2p(fabrics: list[Fabric]) -> None:
    a, b = fabrics[0], fabrics[1]
    page, pages = 64 << 10, 512  # 32 MiB, a KV cache's pages
    src = torch.randint(0, 256, (pages * page,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    a.register("kv", src)
    b.register("kv", dst)
    sent, landed = list(range(0, pages, 2)), list(reversed(range(1, pages, 2)))
    deadline = Deadline.after(60)
    out, into = [(p * page, page) for p in sent], [(p * page, page) for p in landed]
    _ok(run_all([
        partial(send_regions, a, 1, "kv", out, Stream.KV, deadline, options=OPTIONS),
        partial(recv_regions, b, 0, "kv", into, Stream.KV, deadline, options=OPTIONS),
    ]))
    got = dst.view(pages, page)[torch.tensor(landed, device="cuda")]  # a consumer kernel after the wait
    assert torch.equal(got, src.view(pages, page)[torch.tensor(sent, device="cuda")])


def test_a_send_carries_what_the_still_running_producer_writes(fabrics: list[Fabric]) -> None:
    a, b = fabrics[0], fabrics[1]
    n = 4096
    x = torch.randn(n, n, device="cuda")
    src, dst = torch.zeros(n, n, device="cuda"), torch.zeros(n, n, device="cuda")
    a.register("w", src)
    b.register("w", dst)
    torch.cuda.synchronize()
    for _ in range(30):  # ~tens of ms of matmuls on the current stream, the last one writing `src`
        torch.matmul(x, x, out=src)
        torch.mul(src, 1e-3, out=src)
    regions = [(0, src.numel() * 4)]
    deadline = Deadline.after(60)
    _ok(run_all([  # posted at once: the staging copy must wait for the matmuls
        partial(send_regions, a, 1, "w", regions, Stream.PARAMS, deadline, options=OPTIONS),
        partial(recv_regions, b, 0, "w", regions, Stream.PARAMS, deadline, options=OPTIONS),
    ]))
    torch.cuda.synchronize()
    assert src.abs().sum() > 0
    assert torch.equal(dst, src), "the send read the buffer before the producing kernels had finished"


def test_weights_down_a_chain_of_three(fabrics: list[Fabric]) -> None:
    size = 48 << 20
    buffers = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")]
    buffers += [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for fabric, buffer in zip(fabrics, buffers, strict=True):
        fabric.register("weights", buffer)
    regions = [(0, 1 << 20), (1 << 20, size - (1 << 20))]
    landed: dict[int, list[int]] = {1: [], 2: []}
    deadline = Deadline.after(60)
    _ok(run_all([
        partial(chain_broadcast, fabric, [0, 1, 2], "weights", regions, Stream.PARAMS, deadline,
                landed[r].append if r else None, OPTIONS)
        for r, fabric in enumerate(fabrics)
    ]))
    assert torch.equal(buffers[1], buffers[0]) and torch.equal(buffers[2], buffers[0])
    assert sorted(landed[1]) == sorted(landed[2]) == [0, 1]
