"""Incremental detokenization: the text each new token adds, robust to multi-token characters.

A byte-level BPE token can end in the middle of a UTF-8 character, and many tokenizers change how a
token prints depending on its left neighbour (leading-space markers). So a token's text is the
difference between decoding a short window that ends with it and the same window without it; while
the window decodes to a replacement character the text is held back and released with a later
token (or released as it is once more tokens are held than one UTF-8 character can span). Without
a tokenizer every text is empty and stop sequences cannot be honoured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# How many already-emitted tokens the decode window keeps on the left for context.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes (every token holds at least one): text still incomplete after
# more tokens than this is invalid for good, so it is released as it is. This keeps the decode window
# (and the cost of a step) bounded when a model emits long runs of stray byte tokens.
_MAX_HELD_TOKENS = 6


@dataclass
class DetokState:
    """Per-request cursor into its token list: [prefix, read) is context, [read, end) is pending."""

    prefix_offset: int
    read_offset: int

    @classmethod
    def after_prompt(cls, prompt_len: int) -> DetokState:
        """The state before the first generated token."""
        return cls(prefix_offset=max(prompt_len - _CONTEXT_TOKENS, 0), read_offset=prompt_len)


class Detokenizer:
    """Wraps the checkpoint's tokenizer.json (or nothing) for token texts and final texts."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._special: frozenset[int] = frozenset()
        # decode([id]) per id, filled as ids are met (at most the vocabulary): a pure function of the
        # id, and the left half of nearly every streaming window (see `next_text`)
        self._single: dict[int, str] = {}
        if tokenizer is not None:
            added = tokenizer.get_added_tokens_decoder()
            self._special = frozenset(i for i, tok in added.items() if tok.special)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Detokenizer:
        """Load `tokenizer.json` from the checkpoint folder; no file = no texts."""
        path = Path(model_dir) / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path)) if path.is_file() else None)

    @property
    def available(self) -> bool:
        """Whether a tokenizer was found."""
        return self._tokenizer is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (with the tokenizer's special-token template, as the router would)."""
        if self._tokenizer is None:
            return []
        return list(self._tokenizer.encode(text).ids)

    def is_special(self, token_id: int) -> bool:
        """Whether the token is one of the tokenizer's special tokens."""
        return token_id in self._special

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Plain decode of a token list."""
        if self._tokenizer is None or not ids:
            return ""
        return self._tokenizer.decode(ids if isinstance(ids, list) else list(ids), skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """decode([token_id]) (memoised)."""
        text = self._single.get(token_id)
        if text is None:
            text = self._single[token_id] = self.decode([token_id])
        return text

    def next_text(self, tokens: Sequence[int], state: DetokState) -> str:
        """Text added by the tokens after `state.read_offset` (all of `tokens` is the request so far)."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            return ""
        start, read = state.prefix_offset, state.read_offset
        # After a release the context window is exactly the previous step's one token: memoised.
        prefix = self.token_text(tokens[start]) if read - start == 1 else self.decode(tokens[start:read])
        full = tokenizer.decode(tokens[start:], False)  # (the tokenizer itself: one call less per token)
        complete = len(full) > len(prefix) and not full.endswith(_REPLACEMENT)
        if not complete and len(tokens) - state.read_offset <= _MAX_HELD_TOKENS:
            return ""
        state.prefix_offset = state.read_offset
        state.read_offset = len(tokens)
        return full[len(prefix) :]

    def texts_of(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (for prompt tokens, where no streaming context is needed)."""
        return [self.token_text(i) for i in ids]
