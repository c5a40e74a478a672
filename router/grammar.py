"""Structured output on the router's side: a grammar is checked once here, before any replica sees it.

The replicas compile the same grammar against their tokenizer (replica/engine/grammar.py, the same
library: xgrammar) and mask the sampler with it; the router only needs to know that it compiles, so
a bad schema or expression is the client's 400 instead of a batch the replicas refuse. Checks are
memoised by text: a client that sends one schema with every request pays for it once.
"""

from __future__ import annotations

import functools
import re

from router.types import Grammar, GrammarKind

# Grammar texts whose verdict is remembered (a schema is a few hundred bytes to a few KiB)
_CHECKED = 1024


def grammar_error(grammar: Grammar) -> str | None:
    """Why `grammar` does not compile, in one line; None when it does."""
    return _error(grammar.kind, grammar.text)


@functools.lru_cache(maxsize=_CHECKED)
def _error(kind: GrammarKind, text: str) -> str | None:
    import xgrammar as xgr  # imported on first use: a router that never sees a grammar does not load it

    try:
        if kind is GrammarKind.REGEX:
            xgr.Grammar.from_regex(text)
        elif kind is GrammarKind.JSON_SCHEMA:
            # the replicas' options (replica/engine/grammar.py: compact, strict)
            xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        return _one_line(str(exc)) or type(exc).__name__
    return None


# xgrammar's messages start with a time stamp and the C++ source line, and some with a failed check
_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: .*? is false:\s*")


def _one_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return _NOISE.sub("", lines[0]).strip() if lines else ""
