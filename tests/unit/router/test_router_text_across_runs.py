"""A request's text equals the tokenizer's decode of all its generated ids, whatever re-runs cut it
into (a replica death, or `recompute`: every request continues after its first token): the final
text and the streamed token texts, with the replica's own detokenizer producing each run's texts
on a byte-level tokenizer (every byte one token, so characters split across tokens at will)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from replica.engine.detokenizer import Detokenizer, DetokState
from router.requests import RequestState
from router.types import (
    Finished,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    Generation,
    RequestId,
    SamplingParams,
    StoppingParams,
    TokenEvent,
    TokenInfo,
)

ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
BYTES = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(ALPHABET)}, merges=[]))
BYTES.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
BYTES.decoder = decoders.ByteLevel()
REPLICA = Detokenizer(BYTES)


class Decoder:
    """The router's tokenizer, on the same byte-level vocabulary."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return BYTES.decode(list(ids), skip_special_tokens=skip_special_tokens)


def ids(text: str) -> list[int]:
    return list(BYTES.encode(text).ids)


def generate(prompt: list[int], runs: list[list[int]]) -> tuple[str, str]:
    """Feed each run's tokens with the texts its replica prints; returns (streamed text, final text)."""
    total = sum(len(r) for r in runs)
    request = GenerateRequest(tuple(prompt), SamplingParams(), StoppingParams(total))
    state = RequestState(RequestId(1), request, lambda: 0.0, Decoder())
    for k, run in enumerate(runs):
        if k:
            state.new_run()
        tokens = list(state.current().input_ids)  # the run's prompt: the original + tokens so far
        start, cursor = len(tokens), DetokState.after_prompt(len(tokens))
        for j, token in enumerate(run):
            tokens.append(token)
            text = REPLICA.next_text(tokens, cursor)
            last = k == len(runs) - 1 and j == len(run) - 1
            text_so_far = REPLICA.decode(tokens[start:], True)
            done = Finished(text_so_far, total, FinishReason.LENGTH) if last else None
            state.deliver(Generation(RequestId(1), (TokenInfo(token, text, 0.0),), finished=done))
    events = [state.events.get_nowait() for _ in range(state.events.qsize())]
    final = events[-1]
    assert isinstance(final, FinishEvent)
    return "".join(e.token.text for e in events if isinstance(e, TokenEvent)), final.text


@pytest.mark.parametrize(("generated", "cuts"), [
    ("\u20acab", [1]),  # recompute: the first token is the first byte of a 3-byte character
    ("\u20acab", [2]),  # ... its first two bytes
    ("x\u00e9yz", [2]),  # a 2-byte character split across a re-run
    ("ab\u20accd\u00e9f", [3, 4, 8]),  # several re-runs, two of them inside characters
    ("abc", [1, 2]),  # nothing held at the boundaries
])
def test_streamed_and_final_text_equal_the_decode_of_all_generated_ids(generated: str, cuts: list[int]
                                                                       ) -> None:
    gen = ids(generated)
    runs = [gen[a:b] for a, b in itertools.pairwise([0, *cuts, len(gen)])]
    streamed, final = generate(ids("hi "), runs)
    assert final == BYTES.decode(gen) == generated
    assert streamed == generated


def test_a_lone_invalid_first_byte_keeps_its_replacement_character() -> None:
    # what the tiny model does under `recompute` with a byte token forced by logit_bias
    gen = ids("\u20ac")[:1] * 4
    streamed, final = generate(ids("hi "), [gen[:1], gen[1:]])
    assert final == BYTES.decode(gen) == "\ufffd" * 4
    assert final.startswith(streamed)  # the front end releases the rest from the final text
