"""Holding back streamed text so OpenAI answers never show a stop sequence.

The replica stops *after* a stop sequence appears and reports the text with it; OpenAI's API
returns the text *before* it. While streaming, any tail that could still become a stop sequence is
held back; once a stop sequence is seen, nothing from its first character on is released.
"""

from __future__ import annotations


class StopTrimmer:
    """Feed generated text in pieces; get back the part that is safe to show."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._released = 0
        self._cut: int | None = None

    @property
    def text(self) -> str:
        """Everything fed so far (stop sequences included)."""
        return self._text

    def push(self, piece: str) -> str:
        """Add generated text; return the newly releasable text (possibly empty)."""
        self._text += piece
        if not self._stops:  # the common case, on every streamed token: nothing to hold back
            self._released = len(self._text)
            return piece
        if self._cut is None:
            self._cut = self._find_stop()
        end = self._cut if self._cut is not None else len(self._text) - self._pending_prefix()
        return self._release(end)

    def finish(self, final_text: str | None = None) -> str:
        """The generation ended: release what is left, up to the first stop sequence.

        `final_text` is the scheduler's full text; when it extends what was fed (text the
        incremental detokenizer had not flushed yet) the difference is fed first.
        """
        piece = ""
        if final_text is not None and final_text.startswith(self._text):
            piece = self.push(final_text[len(self._text) :])
        end = self._cut if self._cut is not None else len(self._text)
        return piece + self._release(end)

    def _release(self, end: int) -> str:
        if end <= self._released:
            return ""
        piece = self._text[self._released : end]
        self._released = end
        return piece

    def _find_stop(self) -> int | None:
        # Only a stop ending in the new text can be new: search from where it could start.
        start = max(0, self._released - self._longest)
        hits = [i for s in self._stops if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _pending_prefix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop sequence."""
        for size in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0
