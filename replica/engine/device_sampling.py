"""Batched next-token choice: every stage is a few tensor ops over the (batch, vocab) logits.

The device path of `sampling.choose_next` (the CPU keeps the per-row reference in `sampling.py`).
The semantics are the reference's, row by row, for any mix of greedy, sampling, penalised and plain
rows in one batch; a stage runs only when some row needs it, over the rows that need it:

```
 rows ──host: plan_step──► one int64 payload ──one host→device copy──► device views
 logits ─► grammar masks (constrained rows; their bitmask is a second copy) ─┐
 ─► float32 ─► + logit bias ─► repetition (CTRL) ─► frequency / presence ────────┬─► argmax (greedy)
                                                                                 └─► sampling rows:
   temperature → top-k → top-p → typical-p → log-softmax → argmax(p / E), E ~ Exp(1) from a counter hash
 tokens, their logprobs, top-n ─► pack (float64) ─► one device→host copy ─► Choices
```

Seeded draws use the exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i
with probability p_i. E_i comes from `seeding.race_bits(step_seed(seed, step), i)` computed with int64
tensor ops, so a row's draw depends only on its own seed, step and processed distribution: the same
seed gives the same token whatever batch the row shares and wherever it sits, on the same device
(on another device too, up to float differences in the logits), but not the token the CPU path's
`torch.Generator` draws.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from replica.engine.banned import without_banned
from replica.engine.batched_processors import (
    frequency_rows,
    race_noise,
    repetition_rows,
    top_k_rows,
    top_p_rows,
    typical_rows,
)
from replica.engine.finite import saturate
from replica.engine.grammar import masked
from replica.engine.seeding import MASK32, step_seed
from replica.engine.types import Choice, RowInput

# typical-p's "off" mass: the covered mass never reaches it, so nothing is dropped
_TYPICAL_OFF = 2.0
# top-p's "off" dropped mass: a cumulative mass is never at most -1, so nothing is dropped (0 would drop
# tokens whose probability underflows to 0, which the reference keeps when top_p = 1)
_TOP_P_OFF = -1.0


# ------------------------------------------------------------------------------ host → device
class Segment(NamedTuple):
    """A (rows, cols) block of the payload: ints from `start` of the int part, or floats of the float part."""

    start: int
    rows: int
    cols: int


class Payload:
    """The host values of one step (int64, then float64), sent to the device in one copy."""

    def __init__(self) -> None:
        self.ints = array("q")
        self.floats = array("d")

    def add_ints(self, values: Sequence[int] | array[int], cols: int = 1) -> Segment:
        start = len(self.ints)
        self.ints.extend(values)
        return Segment(start, (len(self.ints) - start) // cols, cols)

    def add_padded(self, seqs: Sequence[Sequence[int]], pad: int) -> Segment:
        """Token sequences as a (len(seqs), longest) block padded with `pad`."""
        width = max(map(len, seqs))
        start = len(self.ints)
        filler = array("q", [pad])
        for seq in seqs:
            self.ints += array("q", seq)  # twice as fast as extend() from a list
            self.ints += filler * (width - len(seq))
        return Segment(start, len(seqs), width)

    def add_floats(self, values: Sequence[float]) -> Segment:
        start = len(self.floats)
        self.floats.extend(values)
        return Segment(start, len(values), 1)

    def send(self, device: torch.device) -> OnDevice:
        """One copy to `device` (from pinned memory, asynchronous, on CUDA); floats travel as their bits."""
        if not self.ints and not self.floats:  # a plain greedy batch sends nothing
            nothing = torch.empty(0, dtype=torch.int64, device=device)
            return OnDevice(nothing, nothing.view(torch.float64))
        raw = bytearray(self.ints.tobytes())
        raw += self.floats.tobytes()
        host = torch.frombuffer(raw, dtype=torch.int64)
        # pinned: the copy runs asynchronously and the caching host allocator keeps the buffer until it ends
        sent = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        count = len(self.ints)
        return OnDevice(sent[:count], sent[count:].view(torch.float64))


class OnDevice(NamedTuple):
    """The payload on the device."""

    ints: torch.Tensor
    floats: torch.Tensor

    def int_block(self, seg: Segment) -> torch.Tensor:
        """(rows, cols) int64."""
        return self.ints[seg.start : seg.start + seg.rows * seg.cols].view(seg.rows, seg.cols)

    def float_column(self, seg: Segment) -> torch.Tensor:
        """(rows, 1) float32 (rounded from the host's double once, as a Python scalar would be)."""
        return self.floats[seg.start : seg.start + seg.rows].view(seg.rows, 1).float()


# ------------------------------------------------------------------------------ the plan of one step
@dataclass(frozen=True)
class Stage:
    """Rows (indices into the batch) a stage applies to; `whole` when that is every row, in order."""

    rows: Segment
    whole: bool


@dataclass(frozen=True)
class SamplePlan:
    """The sampling rows' warpers (None: no sampling row uses it) and their race keys (lo, hi words)."""

    stage: Stage
    keys: Segment
    temperature: Segment | None
    top_k: Segment | None
    top_k_max: int
    top_p_drop: Segment | None
    typical: Segment | None


@dataclass(frozen=True)
class StepPlan:
    """What one step needs on the device; stages no row needs are None."""

    payload: Payload
    bias: tuple[Segment, Segment, Segment] | None  # (row, token id, bias) triples
    repetition: tuple[Stage, Segment, Segment] | None  # rows, penalty, prompt+output (padded)
    frequency: tuple[Stage, Segment, Segment, Segment] | None  # rows, frequency, presence, output
    sample: SamplePlan | None
    top_n: tuple[int, ...]
    top_n_max: int


def plan_step(rows: Sequence[RowInput], vocab: int) -> StepPlan:
    """Gather the per-row numbers of one step on the host (only rows that need a stage appear in it)."""
    payload = Payload()
    bias, repeat, frequency, sample = [], [], [], []
    for i, inp in enumerate(rows):
        params = inp.params
        if params.is_plain_greedy:
            continue
        if params.logit_bias:
            bias.append(i)
        if params.repetition_penalty != 1.0 and inp.tokens:
            repeat.append(i)
        if (params.frequency_penalty or params.presence_penalty) and len(inp.tokens) > inp.prompt_len:
            frequency.append(i)
        if params.do_sample:
            sample.append(i)
    top_n = tuple(min(inp.top_n, vocab) for inp in rows)
    return StepPlan(
        payload,
        _plan_bias(payload, rows, bias) if bias else None,
        _plan_repetition(payload, rows, repeat, vocab) if repeat else None,
        _plan_frequency(payload, rows, frequency, vocab) if frequency else None,
        _plan_sample(payload, rows, sample, vocab) if sample else None,
        top_n,
        max(top_n, default=0),
    )


def _stage(payload: Payload, indices: list[int], batch: int) -> Stage:
    return Stage(payload.add_ints(indices), len(indices) == batch)


def _plan_bias(
    payload: Payload, rows: Sequence[RowInput], indices: list[int]
) -> tuple[Segment, Segment, Segment]:
    which: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i in indices:
        pairs = rows[i].params.logit_bias
        which.extend([i] * len(pairs))
        ids.extend(token for token, _ in pairs)
        values.extend(value for _, value in pairs)
    return payload.add_ints(which), payload.add_ints(ids), payload.add_floats(values)


def _plan_repetition(
    payload: Payload, rows: Sequence[RowInput], indices: list[int], vocab: int
) -> tuple[Stage, Segment, Segment]:
    penalty = payload.add_floats([rows[i].params.repetition_penalty for i in indices])
    seen = payload.add_padded([rows[i].tokens for i in indices], pad=vocab)
    return _stage(payload, indices, len(rows)), penalty, seen


def _plan_frequency(
    payload: Payload, rows: Sequence[RowInput], indices: list[int], vocab: int
) -> tuple[Stage, Segment, Segment, Segment]:
    frequency = payload.add_floats([rows[i].params.frequency_penalty for i in indices])
    presence = payload.add_floats([rows[i].params.presence_penalty for i in indices])
    output = payload.add_padded([rows[i].tokens[rows[i].prompt_len :] for i in indices], pad=vocab)
    return _stage(payload, indices, len(rows)), frequency, presence, output


def _plan_sample(payload: Payload, rows: Sequence[RowInput], indices: list[int], vocab: int) -> SamplePlan:
    params = [rows[i].params for i in indices]
    keys: list[int] = []
    for i, p in zip(indices, params, strict=True):
        seed64 = step_seed(p.seed, rows[i].num_generated)
        keys += (seed64 & MASK32, seed64 >> 32)
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    return SamplePlan(
        stage=_stage(payload, indices, len(rows)),
        keys=payload.add_ints(keys, cols=2),
        temperature=(
            payload.add_floats([p.temperature for p in params])
            if any(p.temperature != 1.0 for p in params)
            else None
        ),
        top_k=payload.add_ints(top_k) if any(top_k) else None,
        top_k_max=max(top_k),
        top_p_drop=(
            payload.add_floats([1.0 - p.top_p if p.top_p < 1.0 else _TOP_P_OFF for p in params])
            if any(p.top_p < 1.0 for p in params)
            else None
        ),
        typical=(
            payload.add_floats([p.typical_p if p.typical_p < 1.0 else _TYPICAL_OFF for p in params])
            if any(p.typical_p < 1.0 for p in params)
            else None
        ),
    )


# ------------------------------------------------------------------------------ the step
def _rows(scores: torch.Tensor, stage: Stage, sent: OnDevice) -> torch.Tensor:
    return scores if stage.whole else scores.index_select(0, sent.int_block(stage.rows).view(-1))


def _put(scores: torch.Tensor, stage: Stage, sent: OnDevice, rows: torch.Tensor) -> torch.Tensor:
    return rows if stage.whole else scores.index_copy(0, sent.int_block(stage.rows).view(-1), rows)


def _penalise(scores: torch.Tensor, plan: StepPlan, sent: OnDevice) -> torch.Tensor:
    """Logit bias, then repetition, then frequency / presence penalties (out of place)."""
    if plan.bias is not None:
        which, ids, values = plan.bias
        indices = (sent.int_block(which).view(-1), sent.int_block(ids).view(-1))
        scores = scores.index_put(indices, sent.float_column(values).view(-1), accumulate=True)
    if plan.repetition is not None:
        stage, penalty, seen = plan.repetition
        rows = repetition_rows(_rows(scores, stage, sent), sent.float_column(penalty), sent.int_block(seen))
        scores = _put(scores, stage, sent, rows)
    if plan.frequency is not None:
        stage, frequency, presence, output = plan.frequency
        rows = _rows(scores, stage, sent)
        rows = frequency_rows(
            rows, sent.float_column(frequency), sent.float_column(presence), sent.int_block(output)
        )
        scores = _put(scores, stage, sent, rows)
    return scores


def _warp(scores: torch.Tensor, plan: SamplePlan, sent: OnDevice) -> torch.Tensor:
    """Temperature → top-k → top-p → typical-p (transformers' order) on the sampling rows."""
    if plan.temperature is not None:
        scores = saturate(scores / sent.float_column(plan.temperature), scores)
    if plan.top_k is not None:
        scores = top_k_rows(scores, sent.int_block(plan.top_k), plan.top_k_max)
    if plan.top_p_drop is not None:
        scores = top_p_rows(scores, sent.float_column(plan.top_p_drop))
    if plan.typical is not None:
        scores = typical_rows(scores, sent.float_column(plan.typical))
    return scores


def choose_tensors(logits: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (batch,), final log-probabilities (batch, vocab)) on the logits' device."""
    sent = plan.payload.send(logits.device)
    scores = _penalise(logits.float(), plan, sent)
    sample = plan.sample
    if sample is None:
        return scores.argmax(dim=-1), torch.log_softmax(scores, dim=-1)
    greedy = None if sample.stage.whole else scores.argmax(dim=-1)
    scores = _put(scores, sample.stage, sent, _warp(_rows(scores, sample.stage, sent), sample, sent))
    logprobs = torch.log_softmax(scores, dim=-1)
    noise = race_noise(sent.int_block(sample.keys), scores.shape[-1])
    drawn = (_rows(logprobs, sample.stage, sent).exp() / noise).argmax(dim=-1)
    return (drawn if greedy is None else _put(greedy, sample.stage, sent, drawn)), logprobs


# ------------------------------------------------------------------------------ device → host
def pack_choices(
    tokens: torch.Tensor, logprobs: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """(batch, 2 + 2 n) float64: token, its logprob, n top ids, n top logprobs.

    float64 holds every integer below 2^53 and every float32 (-inf and NaN included) exactly, so ids
    and logprobs travel together in one tensor, one copy (float32 would hold ids only below 2^24)."""
    columns = [tokens.view(-1, 1), logprobs.view(-1, 1)]
    if top is not None:
        columns += top
    return torch.cat([c.to(torch.float64) for c in columns], dim=1)


def to_host(packed: torch.Tensor) -> list[list[float]]:
    """The step's one device → host copy."""
    return packed.tolist()


def unpack_choices(host: list[list[float]], top_n: Sequence[int], width: int) -> list[Choice]:
    """Choices from `to_host(pack_choices(...))`; row i keeps its first top_n[i] of `width` alternatives."""
    if width == 0:
        return [Choice(int(row[0]), row[1]) for row in host]
    choices = []
    for row, n in zip(host, top_n, strict=True):
        ids = tuple(int(t) for t in row[2 : 2 + n])
        choices.append(Choice(int(row[0]), row[1], ids, tuple(row[2 + width : 2 + width + n])))
    return choices


def choose_batched(logits: torch.Tensor, rows: Sequence[RowInput]) -> list[Choice]:
    """One next token per row of `logits` (batch, vocab), on any device, with one copy each way."""
    plan = plan_step(rows, logits.shape[-1])
    tokens, logprobs = choose_tensors(without_banned(masked(logits, rows), rows), plan)
    chosen = logprobs.gather(1, tokens.view(-1, 1))
    top = None
    if plan.top_n_max:
        best = torch.topk(logprobs, plan.top_n_max, dim=-1)
        top = (best.indices, best.values)
    return unpack_choices(to_host(pack_choices(tokens, chosen, top)), plan.top_n, plan.top_n_max)
