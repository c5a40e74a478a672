"""What the front end knows about the served model and its limits (given by the router at start)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServingInfo:
    """The served model, its limits and the numbers `/info` and `/v1/models` report.

    `max_input_tokens` bounds a prompt after tokenization (and truncation); `max_total_tokens`
    bounds prompt + new tokens. `default_max_new_tokens` applies when a TGI or chat request does
    not say (capped so the total stays within `max_total_tokens`). `ignore_unknown_fields`: drop
    request fields the API models do not name instead of refusing them with a 400. `model_root`:
    where the checkpoint was loaded from (vLLM's `root` in /v1/models).
    """

    model_id: str
    max_input_tokens: int
    max_total_tokens: int
    default_max_new_tokens: int = 256
    version: str = "0.1.0"
    model_dtype: str = "float32"
    model_device_type: str = "cpu"
    max_concurrent_requests: int = 512
    max_stop_sequences: int = 8
    max_top_n_tokens: int = 20
    max_batch_total_tokens: int | None = None
    vocab_size: int | None = None
    ignore_unknown_fields: bool = False
    model_root: str = ""  # the checkpoint /v1/models reports as `root` (empty: the model id)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not 1 <= self.max_input_tokens <= self.max_total_tokens:
            raise ValueError("need 1 <= max_input_tokens <= max_total_tokens")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be >= 1")
