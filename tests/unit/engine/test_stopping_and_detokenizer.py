"""Stopping criteria and incremental detokenization (a byte-level BPE trained in memory)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from replica.engine.detokenizer import Detokenizer, DetokState
from replica.engine.stopping import StopChecker
from replica.engine.types import FinishReason, StoppingParams

CORPUS = ["the cafÉ serves crème brûlée 🍰 and tea", "hello world, the end", "naïve façade 你好世界"] * 5


@pytest.fixture(scope="module")
def detok() -> Detokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return Detokenizer(tok)


def test_incremental_texts_concatenate_to_the_full_decode(detok: Detokenizer) -> None:
    prompt = detok.encode("hello ")
    generated = detok.encode("the cafÉ 🍰 你好世界 crème")
    tokens = list(prompt)
    state = DetokState.after_prompt(len(prompt))
    pieces = []
    for t in generated:
        tokens.append(t)
        pieces.append(detok.next_text(tokens, state))
    assert "".join(pieces) == detok.decode(generated)
    assert all("\ufffd" not in p for p in pieces)


def test_memoised_token_texts_equal_a_plain_decode(detok: Detokenizer) -> None:
    ids = list(range(300))
    assert detok.texts_of(ids) == [detok.decode([i]) for i in ids]
    assert detok.texts_of(ids) == [detok.token_text(i) for i in ids]  # second pass: from the memo


def test_special_tokens_and_no_tokenizer(detok: Detokenizer) -> None:
    assert detok.is_special(0) and not detok.is_special(100)
    none = Detokenizer(None)
    assert not none.available and none.encode("x") == [] and none.decode([1, 2]) == ""
    assert none.next_text([1, 2], DetokState.after_prompt(1)) == ""


def _checker(**kwargs: object) -> StopChecker:
    return StopChecker(StoppingParams(**kwargs), eos_token_ids={2})  # type: ignore[arg-type]


def test_length_eos_and_ignore_eos() -> None:
    stop = _checker(max_new_tokens=3)
    assert [stop.step(5, "a"), stop.step(6, "b"), stop.step(7, "c")] == [None, None, FinishReason.LENGTH]
    assert _checker(max_new_tokens=9).step(2, "</s>") is FinishReason.EOS_TOKEN
    assert _checker(max_new_tokens=9, ignore_eos=True).step(2, "</s>") is None


def test_stop_sequence_spanning_tokens_and_inside_one() -> None:
    stop = _checker(max_new_tokens=20, stop_sequences=("END",))
    assert [stop.step(5, t) for t in ("xE", "N", "")] == [None, None, None]
    assert stop.step(6, "Dy") is FinishReason.STOP_SEQUENCE
    inside = _checker(max_new_tokens=20, stop_sequences=("cd",))
    assert inside.step(5, "abcdef") is FinishReason.STOP_SEQUENCE


def test_eos_wins_over_length() -> None:
    assert _checker(max_new_tokens=1).step(2, "") is FinishReason.EOS_TOKEN


def test_stray_bytes_are_released_and_the_window_stays_bounded(detok: Detokenizer) -> None:
    # "🍰" is 4 UTF-8 bytes; its first byte alone, repeated, never completes a character.
    lead = detok.encode("🍰")[0]
    assert detok.decode([lead]).endswith("\ufffd")
    tokens = [*detok.encode("hello "), *[lead] * 40]
    state = DetokState.after_prompt(len(tokens) - 40)
    texts: list[str] = []
    for end in range(len(tokens) - 40 + 1, len(tokens) + 1):
        texts.append(detok.next_text(tokens[:end], state))
        assert end - state.prefix_offset <= 20  # the decode window never grows with the run
    assert any(texts) and "".join(texts).count("\ufffd") >= 30


@pytest.mark.parametrize("prompt_tail", [b"\xe4\xbd", b"\xc3", b"ok \xf0\x9f\x8d"])
def test_a_prompt_ending_in_half_a_character_does_not_swallow_generated_bytes(
        detok: Detokenizer, prompt_tail: bytes) -> None:
    # Random prompt ids (a trace replayed as token ids) can end in the middle of a UTF-8 character.
    # The text of the generated ids must still be their own decode, however their bytes would
    # combine with the prompt's.
    prompt = detok.encode("hello ") + _raw(detok, prompt_tail)
    generated = _raw(detok, b"\xa0") + detok.encode("Wh") + _raw(detok, b"\x80\xbf") + detok.encode(" tea")
    tokens = list(prompt)
    state = detok.state_after(prompt)
    pieces = []
    for t in generated:
        tokens.append(t)
        pieces.append(detok.next_text(tokens, state))
    assert "".join(pieces) == detok.decode(generated)


def _raw(detok: Detokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte of `data` (bytes that need not be valid UTF-8)."""
    tokenizer = detok._tokenizer
    assert tokenizer is not None
    alphabet = _byte_to_unicode()
    return [tokenizer.token_to_id(alphabet[b]) for b in data]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
