"""Which engine a cluster's replicas run: the torch model, or a simulated GPU (`--engine simulated`).

```
 EngineSpec ─ replica_args()  ─► pdcluster replica --engine simulated --gpu … --model-card … --byte-scale …
            ─ model_folder()  ─► the router's --model: the card's config.json (its sizes: KV bytes per
                                 token, weights, vocabulary, context) beside the tokenizer files of the
                                 given checkpoint (texts); the replicas read their tokenizer there too
            ─ link_args()     ─► full-scale Gbit/s stay as given: a simulated replica paces its links,
                                 disk and host memory at them times its byte scale itself
```
Shared by `pdcluster up`, the experiment harness and the virtual-time simulator (`pdcluster simulate`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from replica.engine.sim.cards import card_dict
from replica.engine.sim.gpus import gpu

ENGINES = ("torch", "simulated")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@dataclass(frozen=True)
class EngineSpec:
    """The replicas' engine and, when simulated, the GPU and model they behave like."""

    kind: str = "torch"
    gpu: str = "a100-80g"
    model_card: str = "llama-2-7b"
    byte_scale: str = "1/256"
    profile: Path | None = None
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    device: str = "cpu"  # torch: cpu, cuda, cuda:N or auto (placed by gpu_placement, like `up`)
    fabric: str = "tcp"  # the replicas' --fabric
    dtype: str = ""  # torch: the replicas' --dtype ("" = each device's default)

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ValueError(f"engine {self.kind!r} is not one of {', '.join(ENGINES)}")
        if self.simulated and (self.device not in ("cpu", "auto") or self.dtype):
            raise ValueError("a simulated engine runs on no device and takes its card's dtype: "
                             "no --device or --dtype")
        if self.simulated:
            gpu(self.gpu)  # an unknown name → ValueError naming the known ones
            card_dict(self.model_card)
            if not 0 < self.scale <= 1:
                raise ValueError(f"byte_scale must be in (0, 1], got {self.byte_scale}")
            if self.profile is not None and not Path(self.profile).is_file():
                raise ValueError(f"profile table {self.profile} does not exist")

    @property
    def simulated(self) -> bool:
        """Replicas behave like a GPU; nothing is computed."""
        return self.kind == "simulated"

    @property
    def scale(self) -> float:
        """The byte scale as a number."""
        try:
            return float(Fraction(self.byte_scale))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"byte_scale must be a number or a fraction, got {self.byte_scale!r}") from None

    def replica_args(self) -> list[str]:
        """`pdcluster replica` flags of this engine (torch: its dtype; the device is placed per replica)."""
        if not self.simulated:
            return ["--dtype", self.dtype] if self.dtype else []
        args = ["--engine", "simulated", "--gpu", self.gpu, "--model-card", self.model_card,
                "--byte-scale", self.byte_scale, "--compute-efficiency", str(self.compute_efficiency),
                "--memory-efficiency", str(self.memory_efficiency)]
        if self.profile is not None:
            args += ["--profile", str(self.profile)]
        return args

    def model_folder(self, checkpoint: Path | None, folder: Path) -> Path:
        """The folder the router (and the replicas' tokenizers) read: the checkpoint itself for torch;
        for a simulated engine, `folder` with the card's config.json and the checkpoint's tokenizer."""
        if not self.simulated:
            if checkpoint is None:
                raise ValueError("the torch engine needs a checkpoint folder")
            return checkpoint
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(card_dict(self.model_card), indent=1) + "\n")
        for name in TOKENIZER_FILES:
            source = checkpoint / name if checkpoint is not None else None
            if source is not None and source.is_file():
                shutil.copyfile(source, folder / name)
        return folder
