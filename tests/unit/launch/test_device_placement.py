"""`pdcluster up --device`: which device each replica runs on and its share of it (a pure function of
replica count, device and visible GPUs), the replica command lines `up` builds from it, and the GPU
count (nvidia-smi narrowed by CUDA_VISIBLE_DEVICES; no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.cluster import local
from pdcluster.cluster.gpu_placement import DeviceSlot, place_on_devices
from pdcluster.cluster.local import LocalCluster, UpConfig
from pdcluster.discovery import discover
from pdcluster.discovery.discover import visible_count, visible_gpu_count
from pdcluster.discovery.nvidia import GpuRecord


def devices(slots: tuple[DeviceSlot, ...]) -> list[tuple[str, float | None]]:
    return [(s.device, None if s.memory_fraction is None else round(s.memory_fraction, 6)) for s in slots]


def test_one_gpu_takes_both_replicas_and_splits_the_fraction() -> None:
    assert devices(place_on_devices(2, "cuda", 1, 0.9)) == [("cuda:0", 0.45), ("cuda:0", 0.45)]
    assert devices(place_on_devices(2, "auto", 1, 0.9)) == [("cuda:0", 0.45), ("cuda:0", 0.45)]


def test_n_gpus_one_replica_each_then_round_robin_sharing() -> None:
    assert devices(place_on_devices(2, "cuda", 2, 0.8)) == [("cuda:0", 0.8), ("cuda:1", 0.8)]
    assert devices(place_on_devices(5, "cuda", 2, 0.9)) == [
        ("cuda:0", 0.3), ("cuda:1", 0.45), ("cuda:0", 0.3), ("cuda:1", 0.45), ("cuda:0", 0.3)]
    assert devices(place_on_devices(2, "cuda", 8, 0.9)) == [("cuda:0", 0.9), ("cuda:1", 0.9)]


def test_cuda_n_puts_every_replica_on_that_gpu() -> None:
    assert devices(place_on_devices(3, "cuda:1", 2, 0.9)) == [("cuda:1", 0.3)] * 3
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 visible CUDA device\(s\)"):
        place_on_devices(1, "cuda:2", 2)


def test_cpu_and_auto_without_gpus_stay_on_the_cpu() -> None:
    assert devices(place_on_devices(3, "cpu", 4)) == [("cpu", None)] * 3
    assert devices(place_on_devices(2, "auto", 0)) == [("cpu", None)] * 2
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible"):
        place_on_devices(1, "cuda", 0)
    with pytest.raises(ValueError, match="--device cuda:0: no CUDA device"):
        place_on_devices(1, "cuda:0", 0)


def test_slot_flags() -> None:
    assert DeviceSlot("cpu").replica_args() == ["--device", "cpu"]
    assert DeviceSlot("cuda:1", 0.45).replica_args() == ["--device", "cuda:1", "--gpu-memory-fraction",
                                                         "0.45"]
    assert DeviceSlot("cuda:0", 0.9 / 3).replica_args()[-1] == "0.3"


@pytest.mark.parametrize(("value", "found", "seen"), [
    (None, 4, 4), ("", 4, 0), ("0", 4, 1), ("2,3", 4, 2), ("0,1,-1,2", 4, 2), ("-1", 4, 0),
    ("GPU-1a2b,GPU-3c4d", 8, 2), ("0,1,2", 1, 1), ("0", 0, 0)])
def test_visible_count_follows_cuda_visible_devices(value: str | None, found: int, seen: int) -> None:
    assert visible_count(value, found) == seen


def test_visible_gpu_count_reads_nvidia_smi_not_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    records = [GpuRecord(i, "NVIDIA H100", 81559, f"0000:{i:02x}:00.0") for i in range(2)]
    monkeypatch.setattr(discover, "gpu_records", lambda: (records, "nvidia-smi"))
    assert visible_gpu_count({}) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1"}) == 1


def cluster_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int, **flags: object) -> LocalCluster:
    counted: list[int] = []

    def count() -> int:
        counted.append(gpus)
        return gpus

    monkeypatch.setattr(local, "visible_gpu_count", count)
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")  # inactive replicas want one
    cluster = LocalCluster(UpConfig(model=tmp_path / "m", log_dir=tmp_path / "logs", **flags))  # type: ignore[arg-type]
    cluster.devices = cluster.place_devices()
    cluster.counted = counted  # type: ignore[attr-defined]
    return cluster


def argv(cluster: LocalCluster) -> list[list[str]]:
    return [cluster.replica_argv(rank, role, 9000 + rank, ["--torch-threads", "1"])
            for rank, role in enumerate(cluster.roles())]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_up_on_one_gpu_puts_prefill_and_decode_on_cuda0_with_half_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_of(tmp_path, monkeypatch, 1, device="cuda", prefill=1, decode=1)
    lines = argv(cluster)
    assert [flag(a, "--device") for a in lines] == ["cuda:0", "cuda:0"]
    assert [flag(a, "--gpu-memory-fraction") for a in lines] == ["0.45", "0.45"]
    assert [flag(a, "--rank") for a in lines] == ["0", "1"] and [flag(a, "--port") for a in lines] == [
        "9000", "9001"]


def test_up_on_two_gpus_and_an_inactive_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_of(tmp_path, monkeypatch, 2, device="auto", prefill=1, decode=1, inactive=1,
                         gpu_memory_fraction=0.8)
    lines = argv(cluster)
    assert [flag(a, "--device") for a in lines] == ["cuda:0", "cuda:1", "cuda:0"]
    assert [flag(a, "--gpu-memory-fraction") for a in lines] == ["0.4", "0.8", "0.4"]
    assert "--inactive" in lines[2] and "--inactive" not in lines[0]


def test_up_on_the_cpu_is_what_it_was_plus_device_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    cluster = cluster_of(tmp_path, monkeypatch, 0, decode=1, pin_decode=True)
    lines = argv(cluster)
    assert all(flag(a, "--device") == "cpu" and "--gpu-memory-fraction" not in a for a in lines)
    assert cluster.placement is not None  # the decode replica's engine thread keeps its own core
    assert flag(lines[0], "--engine-cpus") is None
    assert flag(lines[1], "--engine-cpus") == str(min(cluster.placement.decode[0]))
    assert cluster._device_note() == ""  # the ready line as before
    explicit = cluster_of(tmp_path, monkeypatch, 4, device="cpu")
    assert explicit.counted == []  # type: ignore[attr-defined]  # --device cpu runs no nvidia-smi
    assert all(flag(a, "--device") == "cpu" for a in argv(explicit))


def test_up_refuses_what_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible"):
        cluster_of(tmp_path, monkeypatch, 0, device="cuda")
    with pytest.raises(ValueError, match="--device must be cpu, cuda, cuda:N or auto"):
        UpConfig(model=tmp_path, device="gpu")
    with pytest.raises(ValueError, match=r"--gpu-memory-fraction must be in \(0, 1\]"):
        UpConfig(model=tmp_path, gpu_memory_fraction=1.5)
    with pytest.raises(ValueError, match="--device cuda is for the torch engine"):
        UpConfig(model=tmp_path, engine="simulated", device="cuda")
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, float16"):
        UpConfig(model=tmp_path, dtype="fp8")
    with pytest.raises(ValueError, match="--dtype is for the torch engine"):
        UpConfig(model=tmp_path, engine="simulated", dtype="float32")


def test_up_passes_the_dtype_to_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_of(tmp_path, monkeypatch, 1, device="cuda", dtype="float32")
    assert flag(cluster.config.replica_args(), "--dtype") == "float32"  # every replica's common flags
    assert "--dtype" not in UpConfig(model=tmp_path).replica_args()  # unset: each device's default


def test_tp_replicas_take_blocks_of_consecutive_gpus() -> None:
    # 4 GPUs, tp 2: two blocks (cuda:0-1, cuda:2-3); a third replica shares the first block
    assert devices(place_on_devices(3, "cuda", 4, 0.9, tp=2)) == [
        ("cuda:0", 0.45), ("cuda:2", 0.9), ("cuda:0", 0.45)]
    assert devices(place_on_devices(1, "cuda:1", 4, 0.9, tp=3)) == [("cuda:1", 0.9)]
    with pytest.raises(ValueError, match="--tp 4 needs 4 CUDA devices per replica; this machine has 2"):
        place_on_devices(1, "cuda", 2, tp=4)
    with pytest.raises(ValueError, match="a replica of --tp 2 needs 2 from there"):
        place_on_devices(1, "cuda:3", 4, tp=2)
    assert devices(place_on_devices(2, "cpu", 0, tp=4)) == [("cpu", None), ("cpu", None)]


def test_up_passes_tp_to_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_of(tmp_path, monkeypatch, 4, device="cuda", prefill=0, decode=2, tp=2)
    assert flag(cluster.config.replica_args(), "--tp") == "2"
    assert [flag(a, "--device") for a in argv(cluster)] == ["cuda:0", "cuda:2"]
    assert "--tp" not in UpConfig(model=tmp_path).replica_args()
    with pytest.raises(ValueError, match="--tp must be >= 1, and > 1 only for the torch engine"):
        UpConfig(model=tmp_path, engine="simulated", tp=2)
    split = cluster_of(tmp_path, monkeypatch, 6, device="cuda", prefill=1, decode=1, inactive=1, tp=2)
    assert [flag(a, "--device") for a in argv(cluster)] == ["cuda:0", "cuda:2"]  # groups move KV per rank
    assert [flag(a, "--device") for a in argv(split)] == ["cuda:0", "cuda:2", "cuda:4"]
