"""The checkpoint's tokenizer for the router: encode prompts, decode tokens, render chat prompts.

Reads a Hugging Face checkpoint folder without transformers:

    model_dir/tokenizer.json          → `tokenizers.Tokenizer` (encode / decode)
    model_dir/tokenizer_config.json   → chat_template, bos/eos token strings   (optional)
    model_dir/chat_template.jinja     → chat_template (newer checkpoints)       (optional)
    model_dir/config.json             → eos_token_id, vocab_size                (optional)
    model_dir/generation_config.json  → eos_token_id                            (optional)

Chat prompts are rendered with jinja2 in a sandbox, the way transformers renders them (trim_blocks,
lstrip_blocks, `raise_exception`, `tojson`). A checkpoint without a chat template gets
`DEFAULT_CHAT_TEMPLATE`: one ``role: content`` line per message, then ``assistant:`` when a
generation prompt is asked for — plain text, so it tokenizes with any vocabulary.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`) or failed to render."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda obj, indent=None: json.dumps(obj, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode, decode and chat-template rendering for one checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.has_own_chat_template = chat_template is not None
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        ids = list(eos_token_ids)
        if not ids and eos_token and backend.token_to_id(eos_token) is not None:
            ids = [int(backend.token_to_id(eos_token))]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.vocab_size: int = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._template = _compile_template(self.chat_template)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the Hugging Face checkpoint in `path` (needs its tokenizer.json)."""
        folder = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        gen_config = _read_json(folder / "generation_config.json")
        template = tok_config.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        eos = _token_content(tok_config.get("eos_token"))
        eos_ids = _ids(gen_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(int(backend.token_to_id(eos)))
        vocab = model_config.get("vocab_size")
        return cls(
            backend,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=eos,
            eos_token_ids=eos_ids,
            vocab_size=vocab if isinstance(vocab, int) else None,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the checkpoint's post-processor (e.g. BOS)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def encode_with_offsets(self, text: str) -> list[tuple[int, int, int]]:
        """(id, start, stop) of each token of `text` (special tokens included), offsets in characters."""
        encoding = self._backend.encode(text)
        return [(int(i), int(a), int(b)) for i, (a, b) in zip(encoding.ids, encoding.offsets, strict=True)]

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's string for one id (transformers' `convert_ids_to_tokens`)."""
        piece = self._backend.id_to_token(token_id)
        return piece if piece is not None else ""

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (for logprob listings)."""
        return self.decode([token_id], skip_special_tokens=False)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders `tools` (transformers' variable name for them)."""
        return "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render `messages` ([{role, content}, ...]) into one prompt string, with `tools` (OpenAI's
        shape, as transformers passes them) when given.

        The rendered text already holds any BOS the template wants: encode it with
        `add_special_tokens=False`. Raises `ChatTemplateError` when the template refuses.
        """
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
