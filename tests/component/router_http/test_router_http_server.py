"""The front end served by uvicorn over a fake scheduler, driven by the openai and text-generation clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from text_generation import Client

from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from router.types import RequestRejected
from tests.helpers.fake_scheduler import FakeScheduler, expected_text, fake_token
from tests.helpers.router_http import serve, write_word_tokenizer

# The text-generation client calls pydantic's deprecated `.dict()`: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")

MODEL = "tiny-words"
INFO = ServingInfo(model_id=MODEL, max_input_tokens=16, max_total_tokens=40, default_max_new_tokens=8)
ROUTE = {
    "prefill_replica": 0,
    "decode_replica": 1,
    "strategy": "full",
    "migration_bytes": 4096,
    "migration_seconds": 0.002,
    "loading_prefill": False,
    "relay_replica": None,
    "requeues": 0,
    "cached_tokens": 0,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_model_dir(write_word_tokenizer(Path(tmp_path_factory.mktemp("words"))))


@pytest.fixture(scope="module")
def server(tokenizer: Tokenizer) -> Iterator[tuple[str, FakeScheduler]]:
    scheduler = FakeScheduler()
    app = create_app(
        scheduler, tokenizer, INFO, lambda: (b"pdcluster_queue_depth 3.0\n", "text/plain; version=0.0.4")
    )
    with serve(app) as url:
        yield url, scheduler


@pytest.fixture
def url(server: tuple[str, FakeScheduler]) -> str:
    return server[0]


@pytest.fixture
def sched(server: tuple[str, FakeScheduler]) -> Iterator[FakeScheduler]:
    scheduler = server[1]
    fresh = FakeScheduler()
    for name in ("healthy", "token_delay", "reject", "reject_on_first_event", "fail_after", "eos_after"):
        setattr(scheduler, name, getattr(fresh, name))
    scheduler.submitted.clear()
    scheduler.closed.clear()
    scheduler.finished.clear()
    scheduler.closed_event.clear()
    yield scheduler


@pytest.fixture
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_completion_greedy_maps_fields_and_reports_route(
    oai: openai.OpenAI, sched: FakeScheduler, tokenizer: Tokenizer
) -> None:
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt="hello world", max_tokens=5, temperature=0, seed=7, presence_penalty=0.5
    )
    done = raw.parse()
    (req,) = sched.submitted
    assert req.input_ids == tuple(tokenizer.encode("hello world"))
    assert req.sampling.do_sample is False and req.sampling.seed == 7 and req.sampling.presence_penalty == 0.5
    assert req.stopping.max_new_tokens == 5
    assert done.choices[0].text == expected_text(req, 5)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 5)
    assert json.loads(raw.headers["x-pdcluster-route"]) == ROUTE
    assert (done.model_extra or {})["pdcluster_route"] == ROUTE


def test_completion_stream_with_usage_and_route(oai: openai.OpenAI, sched: FakeScheduler) -> None:
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    (req,) = sched.submitted
    assert req.input_ids == (5, 6, 7) and req.sampling.do_sample is True  # OpenAI's default temperature 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(req, 4)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[0].choices[0].finish_reason == "length"
    assert (finish[0].model_extra or {})["pdcluster_route"] == ROUTE
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    details = chunks[-1].usage.prompt_tokens_details  # the OpenAI SDK reads it
    assert details is not None and details.cached_tokens == 0


def test_chat_uses_template_and_trims_stop_sequence(
    oai: openai.OpenAI, sched: FakeScheduler, tokenizer: Tokenizer
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "the cat"},
        {"role": "user", "content": "hello"},
    ]
    probe = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    req = sched.submitted[0]
    prompt = tokenizer.apply_chat_template([dict(m) for m in messages])
    assert req.input_ids == tuple(tokenizer.encode(prompt, add_special_tokens=False))
    assert probe.choices[0].message.content == expected_text(req, 6)
    stop = fake_token(req, 2).text  # the third token's text
    done = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stop=[stop],
    )
    assert done.choices[0].message.content == expected_text(req, 2)
    assert done.choices[0].finish_reason == "stop"
    streamed = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stop=stop,
        stream=True,
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(req, 2)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs_and_eos(oai: openai.OpenAI, sched: FakeScheduler) -> None:
    sched.eos_after = 3
    done = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    req = sched.submitted[0]
    assert req.top_n_tokens == 2
    assert done.choices[0].message.content == expected_text(req, 3)  # the EOS token adds no text
    assert done.choices[0].finish_reason == "stop"
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert content[0].token == fake_token(req, 0).text and content[0].logprob == -0.5
    assert [t.logprob for t in content[0].top_logprobs] == [-0.5, -1.5]


def test_completion_echo_with_logprobs(url: str, sched: FakeScheduler) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 2, "echo": True, "logprobs": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body).json()
    req = sched.submitted[0]
    assert req.prefill_logprobs and req.top_n_tokens == 1
    choice = answer["choices"][0]
    assert choice["text"] == "hello world" + expected_text(req, 2)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][:3] == ["p1", "p43", "p44"] and logprobs["token_logprobs"][0] is None
    assert len(logprobs["tokens"]) == 5 and logprobs["text_offset"][0] == 0


def test_tgi_client_generate_and_stream(url: str, sched: FakeScheduler) -> None:
    client = Client(url, timeout=20)
    answer = client.generate(
        "hello world", max_new_tokens=4, decoder_input_details=True, top_n_tokens=2, seed=3
    )
    req = sched.submitted[0]
    assert req.sampling.do_sample is False and req.prefill_logprobs and req.top_n_tokens == 2
    assert answer.generated_text == expected_text(req, 4)
    assert answer.details.finish_reason.value == "length" and answer.details.generated_tokens == 4
    assert [t.text for t in answer.details.tokens] == [fake_token(req, i).text for i in range(4)]
    assert answer.details.prefill[0].logprob is None and len(answer.details.prefill) == 3
    assert answer.details.top_tokens is not None and len(answer.details.top_tokens[0]) == 2
    events = list(client.generate_stream("hello world", max_new_tokens=3, temperature=0.7))
    stream_req = sched.submitted[1]
    assert stream_req.sampling.do_sample is True and stream_req.sampling.temperature == 0.7
    assert [e.token.text for e in events] == [fake_token(stream_req, i).text for i in range(3)]
    assert events[-1].generated_text == expected_text(stream_req, 3)
    assert events[-1].details is not None and events[-1].details.generated_tokens == 3


def test_tgi_generate_route_single_object_with_timing_headers(url: str, sched: FakeScheduler) -> None:
    params = {"max_new_tokens": 3, "details": True, "return_full_text": True, "stop": ["zzz"]}
    response = httpx.post(f"{url}/generate", json={"inputs": "the cat", "parameters": params})
    assert response.status_code == 200
    body = response.json()
    req = sched.submitted[0]
    assert body["generated_text"] == "the cat" + expected_text(req, 3)
    assert body["details"]["prefill"] == [] and len(body["details"]["tokens"]) == 3
    assert body["pdcluster_route"] == ROUTE
    for header in ("x-first-token-time", "x-total-time", "x-time-per-token", "x-max-time-between-tokens"):
        assert int(response.headers[header]) >= 0
    assert response.headers["x-input-length"] == "3" and response.headers["x-output-length"] == "3"


BAD_OPENAI = [
    ("/v1/completions", b'{"prompt": "hello", ', 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {"prompt": "hello", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hello", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hello", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hello", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hello", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hello", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hello", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 39}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello " * 20}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"5": 101.0}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, 400,
     "logit_bias"),
    ("/v1/completions", {"prompt": "hello", "stop": ["a"] * 9}, 400, "stop"),
    ("/v1/completions", {"prompt": "hello", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50},
        400,
        None,
    ),
]
BAD_TGI = [
    ("/generate", b"not json", 400),
    ("/generate", {"inputs": ""}, 400),
    ("/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 0}}, 400),
    ("/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 100}}, 400),
    ("/generate", {"inputs": "hello", "parameters": {"temperature": 0}}, 400),
    ("/generate", {"inputs": "hello", "parameters": {"top_p": 1.01}}, 400),
    ("/generate", {"inputs": "hello", "parameters": {"top_k": -3}}, 400),
    ("/generate", {"inputs": "hello", "parameters": {"best_of": 2}}, 400),
    ("/generate_stream", {"inputs": "hello", "parameters": {"watermark": True}}, 400),
    ("/generate_stream", {"inputs": "hello " * 20}, 400),
    ("/", {"inputs": 5}, 400),
]


def _post(url: str, path: str, body: bytes | dict[str, object]) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    return httpx.post(url + path, json=body)


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_OPENAI)
def test_bad_openai_input_is_refused_before_queueing(
    url: str, sched: FakeScheduler, path: str, body: bytes | dict[str, object], status: int, param: str | None
) -> None:
    response = _post(url, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    assert sched.submitted == []


@pytest.mark.parametrize(("path", "body", "status"), BAD_TGI)
def test_bad_tgi_input_is_refused_before_queueing(
    url: str, sched: FakeScheduler, path: str, body: bytes | dict[str, object], status: int
) -> None:
    response = _post(url, path, body)
    assert response.status_code == status
    assert set(response.json()) == {"error", "error_type"} and response.json()["error_type"] == "validation"
    assert sched.submitted == []


def test_scheduler_rejection_keeps_its_status(oai: openai.OpenAI, url: str, sched: FakeScheduler) -> None:
    sched.reject = RequestRejected("no replica is serving", 503)
    with pytest.raises(openai.APIStatusError) as caught:
        oai.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert caught.value.status_code == 503 and "no replica" in caught.value.message
    tgi = httpx.post(f"{url}/generate", json={"inputs": "hello"})
    assert tgi.status_code == 503 and tgi.json()["error"] == "no replica is serving"
    sched.reject = None
    sched.reject_on_first_event = RequestRejected("too many pages", 400)
    streamed = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["message"] == "too many pages"


def test_replica_error_mid_stream_and_not(oai: openai.OpenAI, url: str, sched: FakeScheduler) -> None:
    sched.fail_after = 2
    stream = oai.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True)
    with pytest.raises(openai.APIError, match="boom"):
        list(stream)
    whole = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert whole.status_code == 500 and "boom" in whole.json()["error"]["message"]
    sched.fail_after = 0  # fails before any token: the stream has not started, so a plain 5xx
    early = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "stream": True})
    assert early.status_code == 500 and "boom" in early.json()["error"]["message"]
    sched.fail_after = 2
    tgi = httpx.post(f"{url}/generate_stream", json={"inputs": "hello", "parameters": {"max_new_tokens": 5}})
    last = [line for line in tgi.text.splitlines() if line.startswith("data:")][-1]
    assert json.loads(last[5:]) == {
        "error": "generation failed: replica 1 failed the batch: boom",
        "error_type": "generation",
    }


def test_client_disconnect_mid_stream_closes_the_scheduler_iterator(url: str, sched: FakeScheduler) -> None:
    sched.token_delay = 0.02
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 30, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    assert sched.closed_event.wait(10), "the front end never closed the scheduler's iterator"
    assert sched.closed == [0] and sched.finished == []


def test_client_disconnect_while_waiting_for_a_whole_answer(url: str, sched: FakeScheduler) -> None:
    sched.token_delay = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 30}}, timeout=0.3
        )
    assert sched.closed_event.wait(10)
    assert sched.closed == [0]


def test_health_metrics_models_info(url: str, sched: FakeScheduler) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    sched.healthy = False
    assert httpx.get(f"{url}/health").status_code == 503
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.text == "pdcluster_queue_depth 3.0\n" and metrics.headers["content-type"].startswith(
        "text/plain"
    )
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    info = httpx.get(f"{url}/info").json()
    assert (info["model_id"], info["max_input_tokens"], info["max_total_tokens"]) == (MODEL, 16, 40)


def test_defaults_fill_max_tokens(url: str, sched: FakeScheduler) -> None:
    httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
    httpx.post(f"{url}/v1/completions", json={"prompt": "hello"})
    httpx.post(f"{url}/generate", json={"inputs": "hello"})
    chat, completion, tgi = (r.stopping.max_new_tokens for r in sched.submitted)
    assert (chat, completion, tgi) == (INFO.default_max_new_tokens, 16, INFO.default_max_new_tokens)


def test_tgi_truncate_keeps_the_last_tokens(url: str, sched: FakeScheduler, tokenizer: Tokenizer) -> None:
    long_input = " ".join(["w1"] * 30)  # 31 tokens with <s>: over the 16-token limit unless truncated
    response = httpx.post(
        f"{url}/generate", json={"inputs": long_input + " cat", "parameters": {"truncate": 4}}
    )
    assert response.status_code == 200
    (req,) = sched.submitted
    assert req.input_ids == tuple(tokenizer.encode(long_input + " cat")[-4:]) and req.truncate == 4
