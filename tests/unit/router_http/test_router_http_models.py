"""Several models behind one front end: a request's `model` picks the scheduler (OpenAI and TGI
routes), an unknown model is a 404 in each API's format, /v1/models lists every model."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import write_word_tokenizer

CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant:"


def _info(name: str) -> ServingInfo:
    return ServingInfo(model_id=name, max_input_tokens=32, max_total_tokens=64, default_max_new_tokens=4,
                       model_root=f"/models/{name}")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[TestClient, FakeScheduler, FakeScheduler]:
    folder = write_word_tokenizer(Path(tmp_path_factory.mktemp("words")), chat_template=CHAT)
    tokenizer = Tokenizer.from_model_dir(folder)
    first, second = FakeScheduler(), FakeScheduler(healthy=False)
    app = create_app(first, tokenizer, _info("alpha"), lambda: (b"", "text/plain"),
                     more_models=[(second, tokenizer, _info("beta"))])
    return TestClient(app), first, second


def test_the_request_model_picks_the_scheduler(two: tuple[TestClient, FakeScheduler, FakeScheduler]) -> None:
    client, first, second = two
    before = (len(first.submitted), len(second.submitted))
    answer = client.post("/v1/completions", json={"model": "beta", "prompt": "hello world", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == "beta"
    chat = client.post("/v1/chat/completions", json={"model": "alpha", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "the cat"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "alpha"
    tgi = client.post("/generate", json={"inputs": "the cat", "model": "beta",
                                         "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 200
    default = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert default.status_code == 200 and default.json()["model"] == "alpha"
    assert (len(first.submitted), len(second.submitted)) == (before[0] + 2, before[1] + 2)


def test_an_unknown_model_is_a_404_in_each_api_format(
        two: tuple[TestClient, FakeScheduler, FakeScheduler]) -> None:
    client = two[0]
    openai = client.post("/v1/completions", json={"model": "gamma", "prompt": "hello", "max_tokens": 1})
    assert openai.status_code == 404
    error = openai.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "`alpha`, `beta`" in error["message"]
    tgi = client.post("/generate", json={"inputs": "the cat", "model": "gamma"})
    assert tgi.status_code == 404 and tgi.json()["error_type"] == "validation"
    assert "gamma" in tgi.json()["error"]


def test_models_lists_every_model_and_health_follows_any(
        two: tuple[TestClient, FakeScheduler, FakeScheduler]) -> None:
    client = two[0]
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in data] == [("alpha", "/models/alpha"), ("beta", "/models/beta")]
    assert client.get("/health").status_code == 200  # alpha serves (beta is at zero)


def test_info_names_the_model_asked_for(two: tuple[TestClient, FakeScheduler, FakeScheduler]) -> None:
    client = two[0]
    assert client.get("/info").json()["model_id"] == "alpha"
    assert client.get("/info", params={"model": "beta"}).json()["model_id"] == "beta"
    unknown = client.get("/info", params={"model": "gamma"})
    assert unknown.status_code == 404 and "gamma" in unknown.json()["error"]
    document = client.get("/openapi.json").json()["paths"]["/info"]["get"]
    assert [p["name"] for p in document["parameters"]] == ["model"] and "404" in document["responses"]
