"""The cuda-ipc fabric on real GPUs: two processes, torch's CUDA IPC, copies on the fabric stream.

Rank 1 (a child process) sends segments of a CUDA tensor that a slow producer kernel writes right
before the send; rank 0 (this process) receives into segments of its own CUDA tensor and checks
every byte. On one GPU both ranks share it; with two, rank 1 uses the second (peer copies).
Skips without CUDA (or, for the second case, without two GPUs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from transfer.collectives import TransferOptions, recv_regions  # noqa: E402
from transfer.core import Deadline  # noqa: E402
from transfer.ipc.fabric import CudaIpcFabric  # noqa: E402
from transfer.ports import free_ports  # noqa: E402
from transfer.ranktable import RankTable  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[2]
SIZE = (8 << 20) + 4099
SEND = [(0, 4096), (4096 * 3, 1 << 20), ((2 << 20) + 7, SIZE - (2 << 20) - 7 - 4096 - 1)]
RECV = [(SIZE - 4096, 4096), (5, 1 << 20), ((1 << 20) + 4101, SIZE - (2 << 20) - 7 - 4096 - 1)]
OPTIONS = TransferOptions(chunk_bytes=1 << 20)

_SENDER = """
import json, sys
import torch
from transfer.collectives import TransferOptions, send_regions
from transfer.core import Deadline
from transfer.ipc.fabric import CudaIpcFabric
from transfer.ranktable import RankTable
ports, device, size, regions = json.loads(sys.argv[1])
torch.cuda.set_device(device)
src = torch.zeros(size, dtype=torch.uint8, device=device)
fabric = CudaIpcFabric(RankTable.local(ports), 1)
fabric.register("kv", src)
torch.cuda.synchronize()
torch.cuda._sleep(500_000_000)  # a slow producer kernel on the current stream ...
src.copy_((torch.arange(size, device=device) % 251).to(torch.uint8))  # ... writes right before the send
send_regions(fabric, 0, "kv", [tuple(r) for r in regions], 1, Deadline.after(60),
             options=TransferOptions(chunk_bytes=1 << 20))
fabric.close()
"""


def _expected() -> object:
    src = (torch.arange(SIZE) % 251).to(torch.uint8)
    gathered = torch.cat([src[o : o + n] for o, n in SEND])
    out, pos = torch.zeros(SIZE, dtype=torch.uint8), 0
    for o, n in RECV:
        out[o : o + n] = gathered[pos : pos + n]
        pos += n
    return out


@pytest.mark.parametrize("sender_device", [0, 1], ids=["one-gpu", "two-gpus"])
def test_two_processes_move_cuda_segments(sender_device: int) -> None:
    if sender_device >= GPUS:
        pytest.skip(f"needs {sender_device + 1} GPUs, found {GPUS}")
    ports = free_ports(2)
    arg = json.dumps([ports, sender_device, SIZE, SEND])
    child = subprocess.Popen([sys.executable, "-c", _SENDER, arg], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fabric = CudaIpcFabric(RankTable.local(ports), 0)
    try:
        dst = torch.zeros(SIZE, dtype=torch.uint8, device="cuda:0")
        fabric.register("kv", dst)
        recv_regions(fabric, 1, "kv", RECV, 1, Deadline.after(60), options=OPTIONS)
        got = dst.cpu()  # a consumer after the receive completed: the bytes are there
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert torch.equal(got, _expected()), "the bytes differ (a copy overtook the producer kernel?)"
    finally:
        if child.poll() is None:
            child.kill()
        fabric.close()
