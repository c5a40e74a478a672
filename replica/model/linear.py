"""`linear(x, weight, bias)`: the model's matmuls, through oneDNN for float32 on the CPU.

torch's `F.linear` on a float32 CPU tensor calls MKL's sgemm. On the project's machines (AMD EPYC,
AVX-512) oneDNN's inner-product primitive — what vLLM's CPU build runs its linears through — is
1.5–3× faster at every batch a replica sees (1 to 2,048 rows, the 54 M Llama's shapes; measured
2026-11-27, `docs/performance.md#replica`), and its results differ from MKL's only by float32
rounding (a few 1e-6 on unit-scale inputs). The weight is passed as it is, no prepacked copy: the
parameters are views into the flat buffer, which a weight transfer may still be filling, so every
call reads the bytes as they are now. Other dtypes and devices keep `F.linear` (bfloat16 on the CPU
already goes through oneDNN there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# torch builds without oneDNN (or without this op) fall back to F.linear everywhere
_POINTWISE = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, as `F.linear`."""
    if _POINTWISE is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return _POINTWISE(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
