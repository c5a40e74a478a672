"""A request's text across its runs: what its streamed tokens print, and its final text.

A replica detokenizes from the end of the prompt it was given. A continuation's prompt ends with the
tokens earlier runs generated, so text an earlier run still held back at the boundary (the first
bytes of a multi-byte character, or a lone invalid byte that prints as U+FFFD) would be lost: the
new run's detokenizer takes those bytes as settled context. `RunText` notes where the printed text
stopped when a run ends, and re-decodes from there until the new run's replica releases its first
text (from then on the replica's texts line up again). The final text of a request that ran more
than once is the decode of all its generated ids, as the replica's is for a single run.

```
 run 0: … t0 (held: "") │ run 1 (prompt … t0): t1 ("")  t2 ("x": the router prints
                                                      decode(… t0 t1 t2) − decode(…), t0's bytes included)
```
"""

from __future__ import annotations

from collections.abc import Sequence

from router.types import TokenDecoder

# Tokens of left context in a decode window, as the replica's detokenizer keeps.
CONTEXT_TOKENS = 5


class RunText:
    """Stitches token texts across run boundaries for one request."""

    def __init__(self, decoder: TokenDecoder, prompt: tuple[int, ...]) -> None:
        self._decoder = decoder
        self._prompt = prompt
        self.held_from: int | None = None  # index in prompt + generated where printing stopped

    def boundary(self, generated: Sequence[int], texts: Sequence[str]) -> None:
        """A new run starts after `generated` (whose tokens printed `texts`): note any held text.

        A replica holds a token's text back until it completes, so the printed text stops after the
        last token that printed something.
        """
        printed = next((i + 1 for i in range(len(texts) - 1, -1, -1) if texts[i]), 0)
        self.held_from = len(self._prompt) + printed if printed < len(generated) else None

    def text(self, generated: Sequence[int], replica_text: str) -> str:
        """The text of the token just appended to `generated`, from the one its replica printed."""
        start = self.held_from
        if start is None or not replica_text:
            return replica_text  # nothing held, or the replica holds this token's text back too
        self.held_from = None
        ids = [*self._prompt, *generated]
        left = max(start - CONTEXT_TOKENS, 0)
        before = self._decoder.decode(ids[left:start], skip_special_tokens=False)
        return self._decoder.decode(ids[left:], skip_special_tokens=False)[len(before):]

    def final(self, generated: Sequence[int]) -> str:
        """The whole generated text (special tokens skipped, as in a replica's final text)."""
        return self._decoder.decode(generated, skip_special_tokens=True)
