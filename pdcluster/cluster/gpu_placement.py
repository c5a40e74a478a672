"""Which device each replica of a local cluster runs on (`pdcluster up --device`), and its share of it.

```
 place_on_devices(replicas=3, "cuda", gpus=2, fraction=0.9)
   rank 0 ─► cuda:0  0.45 ┐ two share cuda:0: each gets half of --gpu-memory-fraction
   rank 1 ─► cuda:1  0.9  │ alone on cuda:1: all of it
   rank 2 ─► cuda:0  0.45 ┘ round-robin over the visible GPUs
```
`cpu`, and `auto` where no GPU is visible, put every replica on the CPU (what `up` always did).
`cuda:N` puts every replica on that one device. Pure: the GPU count is an input
(`pdcluster.discovery.discover.visible_gpu_count` counts them without importing torch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSlot:
    """One replica's device (as the replica process numbers it) and the share of it it may take."""

    device: str  # "cpu" or "cuda:N"
    memory_fraction: float | None = None  # of the device's memory; None on the CPU

    @property
    def is_cuda(self) -> bool:
        """On a CUDA device."""
        return self.device.startswith("cuda")

    def replica_args(self) -> list[str]:
        """`--device D` and, on CUDA, `--gpu-memory-fraction F` of `pdcluster replica`."""
        if self.memory_fraction is None:
            return ["--device", self.device]
        return ["--device", self.device, "--gpu-memory-fraction", f"{self.memory_fraction:.6g}"]


def place_on_devices(replicas: int, device: str, gpus: int, fraction: float = 0.9,
                     tp: int = 1) -> tuple[DeviceSlot, ...]:
    """The device of each of `replicas` replicas for `--device` (cpu | cuda | cuda:N | auto) on a
    machine with `gpus` visible CUDA devices; replicas sharing a GPU split `fraction` evenly.

    With `tp` > 1 a replica's device is the first of `tp` consecutive GPUs its ranks take (rank r on
    device + r, all on this node); replicas go round-robin over the whole blocks that fit.
    ValueError when `device` asks for a GPU that is not there.
    """
    if replicas < 0 or gpus < 0 or not 0 < fraction <= 1:
        raise ValueError(f"need replicas >= 0, gpus >= 0 and 0 < fraction <= 1, got {replicas}, {gpus}, "
                         f"{fraction}")
    if device == "cpu" or (device == "auto" and gpus == 0):
        return tuple(DeviceSlot("cpu") for _ in range(replicas))
    if gpus == 0:
        raise ValueError(f"--device {device}: no CUDA device is visible on this machine (nvidia-smi "
                         "lists none, or CUDA_VISIBLE_DEVICES hides them); use --device cpu")
    kind, _, index = device.partition(":")
    if kind != "cuda" and device != "auto":
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if index:
        if not index.isdigit() or int(index) + tp > gpus:
            raise ValueError(f"--device {device}: this machine has {gpus} visible CUDA device(s) "
                             f"(cuda:0..cuda:{gpus - 1}), a replica of --tp {tp} needs {tp} from there")
        ordinals = [int(index)] * replicas
    else:
        if tp > gpus:
            raise ValueError(f"--tp {tp} needs {tp} CUDA devices per replica; this machine has {gpus}")
        blocks = gpus // tp
        ordinals = [(rank % blocks) * tp for rank in range(replicas)]
    sharing = Counter(ordinals)
    return tuple(DeviceSlot(f"cuda:{o}", fraction / sharing[o]) for o in ordinals)
