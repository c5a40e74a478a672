"""/tokenize (vLLM's prompt and chat shapes, TGI's shape) and /detokenize, and vLLM's /v1/models fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import write_word_tokenizer

INFO = ServingInfo(model_id="tiny-words", max_input_tokens=32, max_total_tokens=64, model_root="/models/tiny")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[TestClient, FakeScheduler, Tokenizer]:
    tokenizer = Tokenizer.from_model_dir(write_word_tokenizer(Path(tmp_path_factory.mktemp("words"))))
    scheduler = FakeScheduler()
    app = create_app(scheduler, tokenizer, INFO, lambda: (b"", "text/plain"))
    return TestClient(app), scheduler, tokenizer


def test_vllm_tokenize_prompt_and_chat(served: tuple[TestClient, FakeScheduler, Tokenizer]) -> None:
    http, scheduler, tokenizer = served
    answer = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert answer == {
        "count": 3,
        "max_model_len": 64,
        "tokens": [1, 43, 44],
        "token_strs": ["<s>", "hello", "world"],
    }
    answer = http.post(
        "/tokenize", json={"model": "tiny-words", "prompt": "hello", "add_special_tokens": False}
    )
    assert answer.json() == {"count": 1, "max_model_len": 64, "tokens": [43], "token_strs": None}
    messages = [{"role": "user", "content": "the cat"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["count"] > 2
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] != chat["tokens"]
    assert not scheduler.submitted  # nothing queued


def test_tgi_tokenize_offsets_and_truncate(served: tuple[TestClient, FakeScheduler, Tokenizer]) -> None:
    http, _, _ = served
    tokens = http.post("/tokenize", json={"inputs": "the cat sat"}).json()
    assert [t["id"] for t in tokens] == [1, 45, 46, 47]
    assert [(t["text"], t["start"], t["stop"]) for t in tokens[1:]] == [
        ("the", 0, 3),
        ("cat", 4, 7),
        ("sat", 8, 11),
    ]
    last = http.post("/tokenize", json={"inputs": "the cat sat", "parameters": {"truncate": 2}}).json()
    assert last == tokens[-2:]
    refused = http.post("/tokenize", json={"inputs": "the cat", "parameters": {"max_new_tokens": 3}})
    assert refused.status_code == 400 and "max_new_tokens" in refused.json()["error"]


def test_detokenize_round_trip_and_refusals(served: tuple[TestClient, FakeScheduler, Tokenizer]) -> None:
    http, _, _ = served
    assert http.post("/detokenize", json={"tokens": [1, 45, 46]}).json() == {"prompt": "<s> the cat"}
    for body, status, param in (
        ({"tokens": [1, 10_000]}, 400, "tokens"),
        ({"tokens": [1] * 65}, 400, "tokens"),
        ({"tokens": [-1]}, 400, "tokens.0"),
        ({"tokens": [1], "model": "other"}, 404, "model"),
        ({"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
    ):
        answer = http.post("/detokenize", json=body)
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), body
    answer = http.post("/tokenize", json={"prompt": "x", "truncate_prompt_tokens": 2})
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "truncate_prompt_tokens")


def test_model_list_carries_vllm_fields(served: tuple[TestClient, FakeScheduler, Tokenizer]) -> None:
    http, _, _ = served
    (model,) = http.get("/v1/models").json()["data"]
    assert (model["id"], model["root"], model["parent"], model["max_model_len"]) == (
        "tiny-words",
        "/models/tiny",
        None,
        64,
    )
