"""n > 1 (issue 26 part 4): n samples of one prompt submitted together, seeded seed + i, answered
with n indexed choices (one object or one interleaved stream), usage counting the prompt once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler, expected_text
from tests.helpers.router_http import write_word_tokenizer

INFO = ServingInfo(model_id="m", max_input_tokens=16, max_total_tokens=40, default_max_new_tokens=4)


@pytest.fixture
def served(tmp_path: Path) -> tuple[TestClient, FakeScheduler]:
    scheduler = FakeScheduler()
    app = create_app(
        scheduler, Tokenizer.from_model_dir(write_word_tokenizer(tmp_path)), INFO, lambda: (b"", "text/plain")
    )
    return TestClient(app), scheduler


def _chunks(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]


def test_n_samples_one_object(served: tuple[TestClient, FakeScheduler]) -> None:
    http, scheduler = served
    answer = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 3, "n": 3, "seed": 7})
    assert answer.status_code == 200
    body = answer.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [r.sampling.seed for r in scheduler.submitted] == [7, 8, 9]
    assert len({r.input_ids for r in scheduler.submitted}) == 1
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12} | {
        k: v
        for k, v in body["usage"].items()
        if k not in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    chat = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], "n": 2}
    )
    assert [c["index"] for c in chat.json()["choices"]] == [0, 1]
    assert [r.sampling.seed for r in scheduler.submitted[3:]] == [None, None]  # unseeded: independent draws
    assert not scheduler.closed  # every sample finished, none abandoned


def test_n_samples_one_stream(served: tuple[TestClient, FakeScheduler]) -> None:
    http, scheduler = served
    body = {
        "prompt": "hello",
        "max_tokens": 2,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _chunks(http.post("/v1/completions", json=body).text)
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    objects = [json.loads(c) for c in chunks[:-1]]
    usage = [o for o in objects if not o["choices"]]
    assert (
        len(usage) == 1
        and usage[0]["usage"]["completion_tokens"] == 6
        and usage[0]["usage"]["prompt_tokens"] == 2
    )
    texts = {
        i: "".join(o["choices"][0]["text"] for o in objects if o["choices"] and o["choices"][0]["index"] == i)
        for i in range(3)
    }
    assert set(texts.values()) == {expected_text(scheduler.submitted[0], 2)}  # the fake's follow the prompt
    finishes = [
        o["choices"][0]["index"] for o in objects if o["choices"] and o["choices"][0]["finish_reason"]
    ]
    assert sorted(finishes) == [0, 1, 2]
    assert len(scheduler.submitted) == 3 and not scheduler.closed


def test_n_is_bounded_and_a_failure_closes_every_sample(served: tuple[TestClient, FakeScheduler]) -> None:
    http, scheduler = served
    answer = http.post("/v1/completions", json={"prompt": "hello", "n": 17})
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "n")
    http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})  # request 0
    scheduler.fail_after = 1
    failed = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "n": 2})
    assert failed.status_code >= 500
    assert len(scheduler.submitted) == 3 and 2 in scheduler.closed  # the other sample was let go
    stream = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "n": 2, "stream": True})
    # each sample's part ends with its error event (here both fail), and the stream without [DONE]
    assert "[DONE]" not in stream.text and stream.text.count("generation failed") == 2
