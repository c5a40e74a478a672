"""Stopping criteria of one request: end-of-sequence token, stop sequences, length."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from replica.engine.types import FinishReason, StoppingParams


@dataclass
class StopChecker:
    """Fed every generated token and its text; says when (and why) the request is finished."""

    params: StoppingParams
    eos_token_ids: Collection[int]
    generated: int = 0
    output: str = field(default="")  # the tail of the generated text that stop sequences can still reach

    @classmethod
    def resuming(cls, params: StoppingParams, eos_token_ids: Collection[int], earlier: str) -> StopChecker:
        """A checker for a request whose earlier runs generated `earlier` (a continuation's text; ""
        for a new request): a stop sequence may start in it and end in this run's text."""
        checker = cls(params, eos_token_ids)
        checker.output = checker._reachable(earlier)
        return checker

    def step(self, token_id: int, text: str) -> FinishReason | None:
        """Account one generated token; the reason to stop now, or None."""
        self.generated += 1
        if self.generated < self.params.min_new_tokens:  # EOS was masked out (`banned`); no stop yet
            if self.params.stop_sequences and text:
                self.output = self._reachable(self.output + text)
            return FinishReason.LENGTH if self.generated >= self.params.max_new_tokens else None
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if text and self.params.stop_sequences and self._hit_stop_sequence(text):
            return FinishReason.STOP_SEQUENCE
        if self.generated >= self.params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def banned(self) -> tuple[int, ...]:
        """The ids the next token must not be: the EOS tokens while min_new_tokens is not reached."""
        if self.params.ignore_eos or self.generated + 1 > self.params.min_new_tokens:
            return ()
        return tuple(self.eos_token_ids)

    def _hit_stop_sequence(self, text: str) -> bool:
        # Only a window touching the new text can hold a match that was not there before, so the
        # output is kept only as far back as the longest stop sequence can reach.
        self.output += text
        hit = False
        for stop in self.params.stop_sequences:
            start = max(len(self.output) - len(text) - len(stop) + 1, 0)
            hit = hit or stop in self.output[start:]
        self.output = self._reachable(self.output)
        return hit

    def _reachable(self, text: str) -> str:
        """The end of `text` that a later stop sequence can still start in (one char short of the longest)."""
        longest = max((len(stop) for stop in self.params.stop_sequences), default=1)
        return text[len(text) - longest + 1 :] if longest > 1 else ""
