"""Helpers for front-end tests: a tiny word-level checkpoint tokenizer and a uvicorn server in a thread."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tests.helpers.eventually import eventually

SPECIALS = ("<unk>", "<s>", "</s>")
WORDS = (*(f"w{i}" for i in range(40)), "hello", "world", "the", "cat", "sat", "user:", "assistant:", ":")


def write_word_tokenizer(
    folder: Path, chat_template: str | None = None, vocab_size: int | None = 200
) -> Path:
    """Write tokenizer.json (+ tokenizer_config.json, config.json) of a whitespace word-level tokenizer.

    Ids: <unk>=0, <s>=1, </s>=2, then `WORDS`. Encoding adds <s> in front (like Llama).
    """
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model_config: dict[str, object] = {"eos_token_id": 2}
    if vocab_size is not None:
        model_config["vocab_size"] = vocab_size
    (folder / "config.json").write_text(json.dumps(model_config))
    return folder


class ThreadedServer:
    """uvicorn serving an ASGI app on 127.0.0.1:<free port> from a background thread."""

    def __init__(self, app: object) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def start(self, timeout: float = 20.0) -> str:
        """Start and return the base URL once listening."""
        self.thread.start()
        eventually(lambda: self.server.started or not self.thread.is_alive(), timeout, message="uvicorn up")
        if not self.server.started:
            raise RuntimeError("uvicorn did not start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self, timeout: float = 20.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)


@contextmanager
def serve(app: object) -> Iterator[str]:
    """Serve `app` for the duration of the block; yields its base URL."""
    server = ThreadedServer(app)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
