"""router.tokenizer on a hand-written word-level checkpoint: encode/decode, eos ids, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Tokenizer
from tests.helpers.router_http import write_word_tokenizer

MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello"}]


def test_encode_decode_specials_eos_and_vocab(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(write_word_tokenizer(tmp_path))
    ids = tok.encode("hello world")
    assert ids == [1, 43, 44] and tok.encode("hello world", add_special_tokens=False) == [43, 44]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<s> hello world"
    assert tok.token_text(2) == "</s>"
    assert tok.eos_token_ids == (2,) and tok.vocab_size == 200
    no_config_vocab = Tokenizer.from_model_dir(write_word_tokenizer(tmp_path / "v", vocab_size=None))
    assert no_config_vocab.vocab_size == 51


def test_default_chat_template_is_documented_plain_text(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(write_word_tokenizer(tmp_path))
    assert not tok.has_own_chat_template and tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert tok.apply_chat_template(MESSAGES) == "<s>system: the cat\nuser: hello\nassistant:"
    assert (
        tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == "<s>system: the cat\nuser: hello\n"
    )


def test_checkpoint_template_with_hf_conveniences(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% for m in messages %}\n  [{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}"
    )
    tok = Tokenizer.from_model_dir(write_word_tokenizer(tmp_path, chat_template=template))
    assert tok.has_own_chat_template
    assert tok.apply_chat_template(MESSAGES[1:]) == '  [USER] "hello"\n[ASSISTANT]</s>'  # trim_blocks
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template(MESSAGES)


def test_chat_template_jinja_file_and_broken_template(tmp_path: Path) -> None:
    folder = write_word_tokenizer(tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }};{% endfor %}")
    assert Tokenizer.from_model_dir(folder).apply_chat_template(MESSAGES) == "the cat;hello;"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].nope.deeper }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_model_dir(folder).apply_chat_template(MESSAGES)


def test_sandbox_refuses_unsafe_templates(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_model_dir(write_word_tokenizer(tmp_path, chat_template=template))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(MESSAGES)


def test_eos_ids_merge_generation_config(tmp_path: Path) -> None:
    folder = write_word_tokenizer(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    assert Tokenizer.from_model_dir(folder).eos_token_ids == (3, 2)
