"""The engine's messages: plain frozen dataclasses and NamedTuples (protobuf stops at the server's edge).

The servicer converts `generate_pb2` messages into these and back; tests hand-build them.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

RequestId = NewType("RequestId", int)
BatchId = NewType("BatchId", int)


class FinishReason(enum.Enum):
    """Why a request stopped generating (values match the proto enum)."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; neutral values mean "off" (the edge maps proto zeros to these)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    watermark: bool = False

    # cached: read for every request at every step (a cached_property writes the instance __dict__
    # directly, so it works on a frozen dataclass and takes no part in ==, hash or repr)
    @functools.cached_property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @functools.cached_property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits: the batched fast path."""
        return not self.do_sample and not self.has_penalties


@dataclass(frozen=True)
class StoppingParams:
    """When a request stops."""

    max_new_tokens: int = 20
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class RequestSpec:
    """One request of a new batch, as the caller sent it."""

    id: RequestId
    input_tokens: tuple[int, ...] = ()
    inputs: str = ""
    truncate: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    prefill_logprobs: bool = False
    top_n_tokens: int = 0


@dataclass(frozen=True)
class BatchSpec:
    """A new batch to prefill."""

    id: BatchId
    requests: tuple[RequestSpec, ...]


@dataclass(frozen=True)
class CachedBatchInfo:
    """What a caller knows of a cached batch."""

    id: BatchId
    request_ids: tuple[RequestId, ...]
    max_tokens: int

    @property
    def size(self) -> int:
        """Number of requests."""
        return len(self.request_ids)


# TokenList and Generation are built for every request at every step: immutable NamedTuples, several
# times cheaper to construct than frozen dataclasses (read the same way: by field name).
class TokenList(NamedTuple):
    """Token ids with their log-probabilities, texts and special flags (parallel tuples)."""

    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    texts: tuple[str, ...] = ()
    is_special: tuple[bool, ...] = ()


@dataclass(frozen=True)
class GeneratedText:
    """The final output of a finished request."""

    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None


class Generation(NamedTuple):
    """What one request produced in one step."""

    request_id: RequestId
    tokens: TokenList
    prefill_tokens: TokenList | None = None
    generated_text: GeneratedText | None = None
    top_tokens: tuple[TokenList, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Result of a prefill or decode step; `batch` is None once every request finished."""

    generations: tuple[Generation, ...]
    batch: CachedBatchInfo | None
    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0
    concat_ns: int = 0


@dataclass(frozen=True)
class DecodeInput:
    """One cached batch to step, with the tokens to append first (one per request, or none)."""

    batch_id: BatchId
    last_iter_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class WarmupSpec:
    """The limits the caller will use; None = this replica's configured limits."""

    max_input_tokens: int | None = None
    max_prefill_tokens: int | None = None
    max_total_tokens: int | None = None
    batch: BatchSpec | None = None  # run this batch (then drop it) instead of the synthetic profile


class HealthState(enum.Enum):
    """What Health reports."""

    SERVING = "serving"
    LOADING = "loading"
    INACTIVE = "inactive"


@dataclass(frozen=True)
class EngineInfo:
    """Model and cache facts (Info)."""

    model_id: str
    dtype: str
    device_type: str
    num_layers: int
    block_size: int
    num_blocks_total: int
    num_blocks_free: int
    embed_ready: bool
    num_layers_loaded: int
    lm_head_ready: bool
    num_cached_batches: int
    max_input_tokens: int
    max_total_tokens: int
    window_size: int | None = None
