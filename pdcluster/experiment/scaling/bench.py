"""`pdcluster bench scaling`: every scaling policy against one burst, through the research harness.

```
 BenchScalingConfig ─► Design (preset: full or --quick, and the flags) ─► OUT/scaling.toml
   ─► pdcluster.experiment: one cell per system ─► OUT/cells/…, OUT/report.md, OUT/plots/ (timelines/)
   ─► figures.system_figures per cell, figures.goals ─► OUT/scaling.json and a table on stdout
```
The checkpoint is built once by `make-tiny-model` options into `--work` and reused. Bandwidths not
given are the reference cluster's scaled by the checkpoint's size (design.Bandwidths.scaled).
With `--engine simulated` the replicas behave like `--gpu` running `--model-card`: the SIMULATED
preset sizes the load for a 7 B model on A100s, the checkpoint is a minute one whose tokenizer alone
is read, and the bandwidths are the reference cluster's full-scale figures (the replicas pace at
them times `--byte-scale`).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.engine import ENGINES, EngineSpec
from pdcluster.experiment.scaling.design import SYSTEMS, Bandwidths, Design, Reference


@dataclass(frozen=True)
class Preset:
    """The sizes of a run: the full benchmark, or the test suite's quick one."""

    tiny: dict[str, Any]
    phases: tuple[tuple[float, float], ...]
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    slo_ttft_ms: float
    slo_tpot_ms: float
    keep_alive: float
    cooldown: float
    num_blocks: int | None  # None: what the simulated GPU's memory leaves
    bandwidths: Bandwidths | None  # None: scaled from the reference cluster
    router_args: tuple[str, ...] = ()  # for every system, before --router-flag's
    request_timeout: float = 300.0


FULL = Preset(
    # 8 layers of a 8192-wide MLP: 202 MB of float32 weights, 4 KiB of KV per token (one KV head)
    tiny={"arch": "llama", "layers": 8, "hidden": 256, "heads": 4, "kv_heads": 1, "intermediate": 8192,
          "vocab": 512, "max_positions": 1024},
    phases=((30.0, 0.4), (30.0, 2.0), (60.0, 0.4)), input_len=(32, 96), output_len=(8, 24),
    slo_ttft_ms=2500.0, slo_tpot_ms=500.0, keep_alive=5.0, cooldown=5.0, num_blocks=1024, bandwidths=None,
    # a prefill batch of this model takes seconds on a CPU core, tens of seconds to minutes when 4
    # replicas and other work share 2 cores: batches stay short, a starved replica that misses beats
    # for less than 2 minutes is not yet a death, and a replica call may take as long as a request
    # may (at the 60 s call deadline, batches failed with DEADLINE_EXCEEDED)
    router_args=("--heartbeat-timeout", "120", "--rpc-timeout", "300", "--max-batch-prefill-tokens", "512"))
QUICK = Preset(
    tiny={"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 1024,
          "vocab": 512},
    phases=((2.0, 1.0), (1.5, 80.0), (5.0, 1.0)), input_len=(256, 448), output_len=(4, 8),
    slo_ttft_ms=5000.0, slo_tpot_ms=1000.0, keep_alive=1.0, cooldown=1.0, num_blocks=1024,
    bandwidths=Bandwidths(link_gbps=0.05, disk_gbps=0.01, host_gbps=0.1),
    # a spike that outruns one prefill replica several times over (the tiny model prefills ~10 k
    # tokens a second on a CPU core; the spike brings ~28 k a second), so seconds of prompt work
    # queue and the planner's next round scales up on a faster machine too; one quiet-phase prompt
    # (a few tens of ms of work) stays under the upper bound
    router_args=("--prefill-lower", "0.02", "--prefill-upper", "0.25", "--decode-lower", "0.05",
                 "--decode-upper", "0.95", "--max-batch-prefill-tokens", "128"),
    request_timeout=60.0)
SIMULATED = Preset(
    # only the tokenizer is read (texts); the weights of this checkpoint are a few hundred KB
    tiny={"arch": "llama", "layers": 1, "hidden": 64, "heads": 2, "kv_heads": 1, "intermediate": 128,
          "vocab": 512},
    # Llama-2-7B on an A100 (roofline, 0.6 of peak FLOP/s): ~14 k prompt tokens/s, so a 1280-token
    # mean prompt takes ~0.1 s and one prefill replica keeps up with ~10 requests/s; 2/s is ~20 % of
    # one (under the planner's 0.3 busy floor, so the quiet phase holds one), the burst of 12/s
    # ~1.1 replicas' worth at the roofline's speed, more with the replicas' own overhead (the peak
    # shape has 2 prefill replicas). A decode step takes ~10 ms;
    # outputs are short so the router's per-token work on a CPU stays small.
    phases=((20.0, 2.0), (30.0, 12.0), (30.0, 2.0)), input_len=(512, 2048), output_len=(16, 48),
    # chat SLOs of a 7 B model on A100s (DistServe's are 0.25–1 s TTFT, 0.1 s TPOT)
    slo_ttft_ms=1000.0, slo_tpot_ms=100.0, keep_alive=5.0, cooldown=5.0, num_blocks=None,
    bandwidths=Bandwidths.full_scale(),
    # scale prefill when 0.5 s of prompt work queues per replica (half the TTFT SLO; at 0.2 s a
    # Poisson clump of three long prompts in the quiet phase already scaled up), back down under
    # 0.1 s; the router's heartbeat allows for replicas sharing a loaded 2-core machine
    router_args=("--prefill-lower", "0.1", "--prefill-upper", "0.5", "--heartbeat-timeout", "30"),
    request_timeout=120.0)


def _preset(what: Callable[[Preset], str]) -> str:
    """The help's note of the presets' values (which an empty or 0 flag takes)."""
    return f"(0 or none: {what(FULL)}; with --quick: {what(QUICK)}; --engine simulated: {what(SIMULATED)})"


@dataclass
class BenchScalingConfig:
    """Options of `pdcluster bench scaling`; a 0 or an empty list takes the preset's value."""

    out: Path = field(default=Path("bench-results/scaling"), metadata={
        "help": "output folder: the experiment (cells/, report.md, plots/) and scaling.json"})
    work: Path = field(default=Path("bench-results/scaling-work"), metadata={
        "help": "where checkpoints are built once and kept"})
    inactive: int = field(default=2, metadata={
        "help": "inactive replicas beside 1 prefill + 1 decode (static-peak serves with all of them)"})
    quick: bool = field(default=False, metadata={
        "help": "the test suite's sizes: a tiny model, a spike of ~60 requests (checks the path only)"})
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS), metadata={
        "help": "what to measure: policies on the small cluster, and static-peak"})
    phases: list[str] = field(default_factory=list, metadata={
        "help": "the load as SECONDS:RATE phases, Poisson within each "
                + _preset(lambda p: " ".join(f"{s:g}:{r:g}" for s, r in p.phases))})
    input_len: list[int] = field(default_factory=list, metadata={
        "help": "prompt tokens: N or LOW HIGH " + _preset(lambda p: "{} {}".format(*p.input_len))})
    output_len: list[int] = field(default_factory=list, metadata={
        "help": "output tokens: N or LOW HIGH " + _preset(lambda p: "{} {}".format(*p.output_len))})
    link_gbps: float = field(default=0.0, metadata={
        "help": "emulated NIC of every replica, Gbit/s (0: 100 x checkpoint bytes / 14 GB; simulated: 100, "
                "paced at that x --byte-scale)"})
    disk_gbps: float = field(default=0.0, metadata={
        "help": "emulated disk of LoadParams, Gbit/s (0: 16 x checkpoint bytes / 14 GB; simulated: 16)"})
    host_gbps: float = field(default=0.0, metadata={
        "help": "emulated host-memory copy of LoadParams, Gbit/s (0: 200 x checkpoint bytes / 14 GB; "
                "simulated: 200)"})
    slo_ttft_ms: float = field(default=0.0, metadata={
        "help": "TTFT SLO, ms " + _preset(lambda p: f"{p.slo_ttft_ms:g}")})
    slo_tpot_ms: float = field(default=0.0, metadata={
        "help": "TPOT SLO, ms " + _preset(lambda p: f"{p.slo_tpot_ms:g}")})
    keep_alive: float = field(default=0.0, metadata={
        "help": "planner: seconds a drained replica keeps its weights "
                + _preset(lambda p: f"{p.keep_alive:g}")})
    cooldown: float = field(default=0.0, metadata={
        "help": "planner: seconds after a scale-up without scale-down "
                + _preset(lambda p: f"{p.cooldown:g}")})
    router_flag: list[str] = field(default_factory=list, metadata={
        "help": "more router flags as NAME=VALUE (e.g. prefill-upper=0.5), for every system"})
    engine: str = field(default="torch", metadata={
        "help": "torch: replicas run a tiny checkpoint on the CPU; simulated: they behave like --gpu running "
                "--model-card (replica/engine/sim/README.md), sized by the simulated preset",
        "choices": list(ENGINES)})
    device: str = field(default="cpu", metadata={
        "help": "torch engine: the replicas' device, cpu, cuda (spread over the visible GPUs, sharing "
                "them as `pdcluster up` does), cuda:N or auto"})
    fabric: str = field(default="tcp", metadata={
        "help": "the replicas' --fabric (tcp, cuda-ipc, nccl, rdma, auto); on GPUs cuda-ipc moves "
                "weights and KV device to device",
        "choices": ["tcp", "cuda-ipc", "nccl", "rdma", "auto"]})
    dtype: str = field(default="", metadata={
        "help": "torch engine: the replicas' --dtype (empty: float32 on the CPU, bfloat16 on CUDA)"})
    gpu: str = field(default="a100-80g", metadata={"help": "simulated GPU (replica/engine/sim/gpus.py)"})
    model_card: str = field(default="llama-2-7b", metadata={
        "help": "simulated model: a built-in card (replica/engine/sim/cards.py) or a config.json file"})
    byte_scale: str = field(default="1/256", metadata={
        "help": "simulated weights, KV pages and link rates are the card's and the flags' times this"})
    profile: Path | None = field(default=None, metadata={
        "help": "simulated step times from this profile table (replica/engine/sim/profile.py)"})
    seed: int = field(default=0, metadata={"help": "seed of arrivals, lengths and prompts"})
    force: bool = field(default=False, metadata={"help": "run cells again that already finished"})
    json_out: Path | None = field(default=None, metadata={
        "help": "where to write the figures (default OUT/scaling.json)", "flag": "--json"})

    def __post_init__(self) -> None:
        self.out, self.work = Path(self.out), Path(self.work)
        if not 2 <= self.inactive <= 8:
            raise ValueError(f"--inactive must be 2..8, got {self.inactive}")
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        if unknown:
            raise ValueError(f"unknown --systems {unknown}; choose from {', '.join(SYSTEMS)}")
        for item in self.phases:
            _phase(item)
        for name, lengths in (("input-len", self.input_len), ("output-len", self.output_len)):
            if lengths and (len(lengths) > 2 or min(lengths) < 1 or lengths[0] > lengths[-1]):
                raise ValueError(f"--{name} takes N or LOW HIGH (1 <= LOW <= HIGH), got {lengths}")
        if any("=" not in f for f in self.router_flag):
            raise ValueError(f"--router-flag takes NAME=VALUE, got {self.router_flag}")
        if self.engine_spec.simulated and self.quick:  # engine_spec checks the GPU, card and scale
            raise ValueError("--quick sizes a tiny CPU model; with --engine simulated give --phases instead")

    @property
    def engine_spec(self) -> EngineSpec:
        """The replicas' engine (ValueError naming the known GPUs or cards on a bad one)."""
        return EngineSpec(self.engine, self.gpu, self.model_card, self.byte_scale,
                          Path(self.profile) if self.profile is not None else None,
                          device=self.device, fabric=self.fabric, dtype=self.dtype)

    @property
    def preset(self) -> Preset:
        """The sizes this run starts from."""
        if self.engine_spec.simulated:
            return SIMULATED
        return QUICK if self.quick else FULL


def _phase(item: str) -> tuple[float, float]:
    seconds, sep, rate = item.partition(":")
    try:
        phase = (float(seconds), float(rate))
    except ValueError:
        phase = (0.0, -1.0)
    if not sep or not (phase[0] > 0 and phase[1] >= 0):
        raise ValueError(f"--phases takes SECONDS:RATE with SECONDS > 0 and RATE >= 0, got {item!r}")
    return phase


def model_folder(work: Path, tiny: dict[str, Any]) -> Path:
    """The cached checkpoint of these make-tiny-model options (named by them, so a change builds anew)."""
    return work / ("model-" + "-".join(f"{k}{v}" for k, v in sorted(tiny.items())))


def checkpoint_bytes(model: Path) -> int:
    """Bytes of the checkpoint's weight files."""
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def card_bytes(model_card: str) -> int:
    """Bytes of a simulated model card's full-size weights."""
    from replica.engine.sim.cards import card_dtype, load_card
    from replica.model.layout import WeightLayout

    return WeightLayout.for_config(load_card(model_card), card_dtype(model_card)).total_bytes


def design_of(config: BenchScalingConfig) -> Design:
    """The design these options describe; builds the checkpoint when it is not cached yet."""
    from pdcluster.experiment.run import ensure_model
    from pdcluster.experiment.spec import ModelSpec

    p, engine = config.preset, config.engine_spec
    model = model_folder(config.work.resolve(), p.tiny)
    ensure_model(ModelSpec(model, p.tiny))
    size = checkpoint_bytes(model)
    derived = p.bandwidths or Bandwidths.scaled(size)
    bandwidths = Bandwidths(config.link_gbps or derived.link_gbps, config.disk_gbps or derived.disk_gbps,
                            config.host_gbps or derived.host_gbps)
    reference = Reference()
    notes: dict[str, Any] = {"checkpoint_bytes": size}
    if engine.simulated:  # the card's full-size weights: what a load moves at the full-scale rates
        notes = {"checkpoint_bytes": card_bytes(engine.model_card),
                 "engine": f"simulated {engine.gpu} {engine.model_card} byte-scale {engine.byte_scale}",
                 "tokenizer_of": str(model), "bandwidths": "full scale (replicas pace at them x byte scale)"}
    notes["reference"] = (f"{reference.model_bytes / 1e9:g} GB model, NVMe {reference.disk_gbps:g}, "
                          f"host {reference.host_gbps:g}, NIC {reference.nic_gbps:g} Gbit/s")
    return Design(
        model=model, tiny=p.tiny, inactive=config.inactive,
        phases=tuple(_phase(i) for i in config.phases) or p.phases,
        input_len=_lengths(config.input_len) or p.input_len,
        output_len=_lengths(config.output_len) or p.output_len,
        bandwidths=bandwidths, slo_ttft_ms=config.slo_ttft_ms or p.slo_ttft_ms,
        slo_tpot_ms=config.slo_tpot_ms or p.slo_tpot_ms, num_blocks=p.num_blocks,
        keep_alive=config.keep_alive or p.keep_alive, cooldown=config.cooldown or p.cooldown,
        router_args=(*p.router_args, *(w for f in config.router_flag for w in _flag(f))),
        systems=tuple(config.systems),
        seed=config.seed, request_timeout=p.request_timeout, notes=notes, engine=engine)


def _lengths(values: list[int]) -> tuple[int, int] | None:
    return (values[0], values[-1]) if values else None


def _flag(item: str) -> list[str]:
    name, _, value = item.partition("=")
    return [f"--{name.removeprefix('--')}", value]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: every cell's processes are stopped


def run(config: BenchScalingConfig) -> int:
    """Runner of `pdcluster bench scaling`: 0 when every cell ran, 1 when one failed."""
    from pdcluster.experiment.load import load_experiment
    from pdcluster.experiment.run import run_experiment
    from pdcluster.experiment.scaling.design import experiment_toml
    from pdcluster.experiment.scaling.results import scaling_results, table

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    design = design_of(config)
    config.out.mkdir(parents=True, exist_ok=True)
    source = config.out / "scaling.toml"
    source.write_text(experiment_toml(design))
    experiment = load_experiment(source)
    outcome = run_experiment(experiment, config.out, config.force)
    results = scaling_results(config.out, design)
    path = config.json_out or config.out / "scaling.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"pdcluster bench scaling: {path}; report {outcome.report}")
    failed = [key for key, o in outcome.ran.items() if o.state != "done"]
    if failed:
        print(f"pdcluster bench scaling: cells not done: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
