"""Structured output: a grammar compiled once per replica, a matcher per request, masks applied batched.

The engine is xgrammar (chosen over llguidance after trying both on this project's tokenizers: it
compiles a JSON Schema in milliseconds, fills a row's bitmask in microseconds, and applies the
bitmask of any subset of a batch's rows in one call on CPU tensors and on CUDA tensors alike, the
path vLLM and SGLang use; llguidance's torch helper cost far more per call on the CPU).

```
 RequestSpec.grammar ─► Grammars.state(spec, generated) ─► GrammarState (compiled grammar cached by spec)
 each step:  rows with a state ─► fill their bitmask rows (host) ─► one copy ─► logits[rows] masked -inf
 each token: GrammarState.accept(token) ─► terminated (EOS accepted, or nothing left to add) = finished
```

A continuation or a migrated request rebuilds its matcher from the tokens generated so far (the
continuation's generated prefix, then DecodeV2's appended tokens), so the constraint survives a
re-run on another replica. JSON comes out with fixed separators (no free whitespace), which also
keeps a model from padding the output with endless blanks.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from replica.engine.types import GrammarKind, GrammarSpec, RowInput
from replica.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr
    from tokenizers import Tokenizer


def _xgr() -> ModuleType:
    """xgrammar (it imports torch): loaded by the first grammar, so an engine that never sees one (the
    simulated engine's torch-free processes) does not load it."""
    import xgrammar

    return xgrammar


# xgrammar's compiled grammars kept per replica (its own cache is keyed the same way: by text)
_CACHE_BYTES = 64 << 20


class GrammarState:
    """One request's matcher: which tokens may come next, advanced by every token the request gets."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # the width of the logits its masks apply to

    def _allowed(self) -> np.ndarray:
        """One flag per token id: may it come next."""
        mask = _xgr().allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(mask)
        return np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (changes nothing)."""
        return (
            not self._matcher.is_terminated()
            and 0 <= token < self.vocab_size
            and bool(self._allowed()[token])
        )

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (nothing changed) when the grammar refuses it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def first_allowed(self, order: Sequence[int], start: int) -> int:
        """The first token of `order`, from `start` on and wrapping round, that may come next; the
        lowest allowed id when none of them may (e.g. only EOS is left). For engines that pick tokens
        without logits (the simulated one)."""
        bits = self._allowed()
        for i in range(len(order)):
            token = order[(start + i) % len(order)]
            if token < len(bits) and bits[token]:
                return int(token)
        return int(np.flatnonzero(bits)[0])

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an xgrammar bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary (built lazily: the first constrained request)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)

    @functools.cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        if self._tokenizer is None:
            raise FailedPrecondition("structured output needs the checkpoint's tokenizer.json")
        # imported here: only a replica that serves a grammar pays for it
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
        info = _xgr().TokenizerInfo.from_huggingface(
            wrapped, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
        )
        return _xgr().GrammarCompiler(info, cache_limit_bytes=_CACHE_BYTES)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar (cached by text); InvalidArgument when it does not compile."""
        try:
            return compile_with(self._compiler, spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"grammar: {spec.kind.name.lower()} does not compile: {exc}") from None

    def state(self, spec: GrammarSpec, generated: Sequence[int]) -> GrammarState:
        """A matcher advanced over `generated` (a continuation's earlier tokens); InvalidArgument when
        the grammar does not compile or refuses one of them."""
        matcher = _xgr().GrammarMatcher(self.compile(spec), override_stop_tokens=self._stop_ids)
        state = GrammarState(matcher, self._vocab_size)
        for i, token in enumerate(generated):
            if not state.accept(token):
                raise InvalidArgument(f"grammar: generated token {i} (id {token}) does not match the grammar")
        return state

    @property
    def vocab_size(self) -> int:
        """Width of the logits the masks apply to."""
        return self._vocab_size


def compile_with(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """Compile `spec` with `compiler`: JSON without free whitespace, and no properties beyond the ones
    a schema lists when it lists some (strict)."""
    if spec.kind is GrammarKind.REGEX:
        return compiler.compile_regex(spec.text)
    schema = spec.text if spec.kind is GrammarKind.JSON_SCHEMA else json.dumps({"type": "object"})
    return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)


def masked(logits: torch.Tensor, rows: Sequence[RowInput]) -> torch.Tensor:
    """`logits` (batch, vocab) with every constrained row's refused tokens at -inf (a copy when any
    row is constrained, float32; the same tensor when none is)."""
    states = [(i, inp.grammar) for i, inp in enumerate(rows) if inp.grammar is not None]
    if not states:
        return logits
    import torch

    xgrammar = _xgr()
    bitmask = xgrammar.allocate_token_bitmask(len(rows), logits.shape[-1])
    for i, state in states:
        state.fill(bitmask, i)
    which = [i for i, _ in states]
    out = logits.clone() if logits.dtype == torch.float32 else logits.float()
    if out.device.type == "cuda":  # from pinned memory, asynchronous like the step's other copy
        bitmask = bitmask.pin_memory().to(out.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=which)
    return out
