"""API keys and per-key limits end to end: uvicorn over the fake scheduler, driven by the openai,
text-generation and httpx clients; 401 in each API's shape, 429 + Retry-After per limit, metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from text_generation import Client
from text_generation.errors import OverloadedError, UnknownError

from router.config import RouterConfig
from router.http import ServingInfo, create_app
from router.http.keys import load_key_file
from router.main import serve as serve_router
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import serve, write_word_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")

MODEL = "tiny-words"
INFO = ServingInfo(model_id=MODEL, max_input_tokens=64, max_total_tokens=512, default_max_new_tokens=8)
KEYS = """\
# KEY                  fields
sk-alice-000000000000  name=alice rpm=3
sk-bob-1111111111111   name=bob concurrent=1
sk-carol-22222222222   name=carol tpm=40
sk-dave-333333333333   # no limits: named line-5
"""
ALICE, BOB, CAROL, DAVE = "sk-alice-000000000000", "sk-bob-1111111111111", "sk-carol-22222222222", (
    "sk-dave-333333333333"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_model_dir(write_word_tokenizer(Path(tmp_path_factory.mktemp("words"))))


@pytest.fixture
def server(tokenizer: Tokenizer, tmp_path: Path) -> Iterator[tuple[str, FakeScheduler]]:
    """A fresh server per test: every key's minute starts empty."""
    (tmp_path / "keys.txt").write_text(KEYS)
    scheduler = FakeScheduler()
    app = create_app(scheduler, tokenizer, INFO, lambda: (b"", "text/plain; version=0.0.4"),
                     load_key_file(tmp_path / "keys.txt"))
    with serve(app) as url:
        yield url, scheduler


def oai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics").text


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of the Prometheus text, or None."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return None


def test_openai_401_shape_and_the_key_is_never_echoed(server: tuple[str, FakeScheduler]) -> None:
    url, sched = server
    with pytest.raises(openai.AuthenticationError) as err:
        oai(url, "sk-wrong-key-9999").completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert err.value.status_code == 401
    assert err.value.body == {
        "message": "invalid API key",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert "sk-wrong" not in err.value.response.text
    assert err.value.response.headers["www-authenticate"].startswith("Bearer")
    missing = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    basic = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Basic {ALICE}"})
    assert basic.status_code == 401 and basic.json()["error"]["code"] == "missing_api_key"
    assert sched.submitted == []
    text = metrics(url)
    assert sample(text, "pdcluster_api_unauthorized_total", reason="invalid") == 1
    assert sample(text, "pdcluster_api_unauthorized_total", reason="missing") == 2


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
def test_tgi_401_shape(server: tuple[str, FakeScheduler], path: str) -> None:
    url, sched = server
    for headers in ({}, {"Authorization": "Bearer nope"}):
        answer = httpx.post(f"{url}{path}", json={"inputs": "hello"}, headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error_type"] == "authentication"
        assert set(answer.json()) == {"error", "error_type"}
    with pytest.raises(UnknownError):
        Client(url, timeout=20).generate("hello", max_new_tokens=2)
    assert Client(url, headers={"Authorization": f"Bearer {DAVE}"}, timeout=20).generate(
        "hello", max_new_tokens=2
    ).generated_text
    assert len(sched.submitted) == 1


def test_open_routes_need_no_key(server: tuple[str, FakeScheduler]) -> None:
    url, _ = server
    for path in ("/health", "/metrics", "/info", "/docs", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 200, path


def test_valid_key_serves_both_apis(server: tuple[str, FakeScheduler]) -> None:
    url, sched = server
    done = oai(url, DAVE).completions.create(model=MODEL, prompt="hello world", max_tokens=3)
    assert done.choices[0].finish_reason == "length"
    assert [m.id for m in oai(url, DAVE).models.list()] == [MODEL]
    tgi = httpx.post(f"{url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}},
                     headers={"authorization": f"bearer {DAVE}"})  # the scheme is case-insensitive
    assert tgi.status_code == 200
    assert len(sched.submitted) == 2
    assert sample(metrics(url), "pdcluster_api_key_requests_total", key="line-5") == 3


def test_requests_per_minute_429_with_retry_after(server: tuple[str, FakeScheduler]) -> None:
    url, sched = server
    client = oai(url, ALICE)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
    assert err.value.body is not None and err.value.body["code"] == "rpm_limit_exceeded"  # type: ignore[index]
    alice = {"Authorization": f"Bearer {ALICE}"}
    tgi = httpx.post(f"{url}/generate", json={"inputs": "hello"}, headers=alice)
    assert tgi.status_code == 429 and tgi.json()["error_type"] == "overloaded"
    assert 1 <= int(tgi.headers["retry-after"]) <= 60
    with pytest.raises(OverloadedError):
        Client(url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=20).generate("hello")
    assert len(sched.submitted) == 3
    text = metrics(url)
    assert sample(text, "pdcluster_api_key_limit", key="alice", limit="rpm") == 3
    assert sample(text, "pdcluster_api_key_rejections_total", key="alice", reason="rpm") == 3
    assert sample(text, "pdcluster_api_key_requests_total", key="alice") == 3


def wait_in_flight(url: str, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sample(metrics(url), "pdcluster_api_key_in_flight", key=name) != value:
        assert time.monotonic() < deadline, f"{name} never had {value} requests in flight"
        time.sleep(0.02)


def test_a_stream_holds_its_concurrency_slot_until_the_client_leaves(
    server: tuple[str, FakeScheduler],
) -> None:
    url, sched = server
    sched.token_delay = 0.05
    client = oai(url, BOB)
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=400, stream=True)
    next(iter(stream))
    wait_in_flight(url, "bob", 1)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.body["code"] == "concurrent_limit_exceeded"  # type: ignore[index]
    stream.close()  # the client leaves mid-stream: the slot frees
    wait_in_flight(url, "bob", 0)
    sched.token_delay = 0.0
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=1).choices[0].text
    # a stream that runs to its end frees the slot too
    assert len(list(client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True))) >= 3
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=1).choices[0].text
    text = metrics(url)
    assert sample(text, "pdcluster_api_key_rejections_total", key="bob", reason="concurrent") == 1
    assert sample(text, "pdcluster_api_key_limit", key="bob", limit="concurrent") == 1


def test_tokens_per_minute_reserve_then_settle(server: tuple[str, FakeScheduler]) -> None:
    url, sched = server
    client = oai(url, CAROL)
    sched.eos_after = 2  # each request stops after 3 tokens: it used 3 + 3, not its reservation of 3 + 30
    for _ in range(2):
        done = client.completions.create(model=MODEL, prompt="hello world", max_tokens=30)
        assert done.usage is not None and done.usage.total_tokens == 6
    sched.eos_after = None
    assert sample(metrics(url), "pdcluster_api_key_tokens_total", key="carol") == 12
    with pytest.raises(openai.RateLimitError) as err:  # 12 used + 33 reserved > 40
        client.completions.create(model=MODEL, prompt="hello world", max_tokens=30)
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
    assert err.value.body["code"] == "tpm_limit_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_big:  # 3 + 38 > 40 can never pass: 400
        client.completions.create(model=MODEL, prompt="hello world", max_tokens=38)
    assert too_big.value.body["code"] == "tpm_limit_exceeded"  # type: ignore[index]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4)
    assert chat.usage is not None
    assert len(sched.submitted) == 3
    text = metrics(url)
    assert sample(text, "pdcluster_api_key_tokens_total", key="carol") == 12 + chat.usage.total_tokens
    assert sample(text, "pdcluster_api_key_rejections_total", key="carol", reason="tpm") == 1
    assert sample(text, "pdcluster_api_key_rejections_total", key="carol", reason="too_large") == 1
    assert sample(text, "pdcluster_api_key_limit", key="carol", limit="tpm") == 40


def test_router_refuses_a_malformed_key_file_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-good name=a\nsk-bad rpm=lots\n")
    code = serve_router(RouterConfig(model=tmp_path / "no-model", api_keys=keys))
    err = capsys.readouterr().err
    assert code == 2
    assert f"{keys}:2: `rpm` must be a whole number >= 1" in err
    assert "sk-bad" not in err and "sk-good" not in err
