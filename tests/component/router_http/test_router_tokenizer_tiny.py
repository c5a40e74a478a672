"""router.tokenizer agrees with transformers' tokenizer on the tiny checkpoint (encode, decode, chat)."""

from __future__ import annotations

from pathlib import Path

from router.tokenizer import Tokenizer

PROMPTS = ["Hello, how are you today?", "The capital of France is", "  spaces\tand\nnewlines  ", "ünïcödé 🐉"]
CHAT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And three?"},
]


def test_matches_transformers_on_tiny_llama(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_model_dir(tiny_llama)
    theirs = AutoTokenizer.from_pretrained(str(tiny_llama))
    for text in PROMPTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for add in (True, False):
        rendered = ours.apply_chat_template(CHAT, add_generation_prompt=add)
        assert rendered == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add)
        assert ours.encode(rendered, add_special_tokens=False) == theirs.apply_chat_template(
            CHAT, tokenize=True, add_generation_prompt=add
        )
    assert ours.has_own_chat_template and ours.eos_token_ids == (theirs.eos_token_id,)
