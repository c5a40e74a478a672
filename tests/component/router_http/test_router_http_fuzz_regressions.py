"""Bugs the Schemathesis run found in the front end, one test each (each failed before its fix)."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from router.types import SamplingParams
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import serve, write_word_tokenizer

INFO = ServingInfo(model_id="tiny-words", max_input_tokens=16, max_total_tokens=40, default_max_new_tokens=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeScheduler]]:
    tokenizer = Tokenizer.from_model_dir(write_word_tokenizer(Path(tmp_path_factory.mktemp("words"))))
    scheduler = FakeScheduler()
    with serve(create_app(scheduler, tokenizer, INFO, lambda: (b"", "text/plain"))) as url:
        yield url, scheduler


def post(server: tuple[str, FakeScheduler], path: str, body: dict[str, Any]) -> httpx.Response:
    server[1].submitted.clear()
    return httpx.post(f"{server[0]}{path}", json=body, timeout=20)


@pytest.mark.parametrize("prompt", [[[-1]], [-1], [[3, 2**64]]])
@pytest.mark.parametrize("echo", [False, True])
def test_token_ids_out_of_range_are_a_400_not_a_500(
    server: tuple[str, FakeScheduler], prompt: list[Any], echo: bool
) -> None:
    """Was: 500 OverflowError (the ids were decoded for echo before their range was checked)."""
    answer = post(server, "/v1/completions", {"prompt": prompt, "echo": echo})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "prompt"


def test_whole_number_floats_are_integers(server: tuple[str, FakeScheduler]) -> None:
    """Was: 400 for `"seed": 156.0`, which JSON Schema's "integer" admits."""
    answer = post(server, "/v1/completions", {"prompt": [5.0, 6], "max_tokens": 2.0, "seed": 156.0})
    assert answer.status_code == 200, answer.text
    (req,) = server[1].submitted
    assert req.input_ids == (5, 6) and req.stopping.max_new_tokens == 2 and req.sampling.seed == 156
    assert type(req.sampling.seed) is int
    tgi = post(server, "/generate", {"inputs": "hello", "parameters": {"top_k": 3.0, "max_new_tokens": 1.0}})
    assert tgi.status_code == 200, tgi.text
    for bad in ({"prompt": "x", "max_tokens": 2.5}, {"prompt": "x", "seed": "7"}, {"prompt": "x", "n": True}):
        assert post(server, "/v1/completions", bad).status_code == 400, bad


def test_chat_max_tokens_is_checked_when_max_completion_tokens_wins(
    server: tuple[str, FakeScheduler],
) -> None:
    """Was: 200 (max_tokens was ignored, even out of its documented range)."""
    messages = [{"role": "user", "content": "hello"}]
    for bad in (0, -5, 40):
        answer = post(server, "/v1/chat/completions",
                      {"messages": messages, "max_tokens": bad, "max_completion_tokens": 3})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens", answer.text
    both = {"messages": messages, "max_tokens": 39, "max_completion_tokens": 3}
    ok = post(server, "/v1/chat/completions", both)
    assert ok.status_code == 200 and server[1].submitted[0].stopping.max_new_tokens == 3


def f32(value: float) -> float:
    """What the replica receives for a protobuf float field."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def replica_accepts(s: SamplingParams) -> bool:
    """The replica's rules (replica/engine/validation.check_sampling): positive finite temperature and
    repetition_penalty, top_p and typical_p in (0, 1], top_k a 32-bit count; the values as the
    replica gets them (32-bit floats)."""
    positive = all(0 < f32(v) < math.inf for v in (s.temperature, s.repetition_penalty))
    in_unit = all(0 < f32(v) <= 1 for v in (s.top_p, s.typical_p))
    return positive and in_unit and 0 <= s.top_k < 2**32


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e39}),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}),
        ("/v1/completions", {"prompt": "x", "temperature": 1e-300}),
        ("/v1/completions", {"prompt": "x", "top_p": 5e-324}),
        ("/v1/completions", {"prompt": "x", "top_k": 2**40}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 2**32}),
        ("/generate", {"inputs": "x", "parameters": {"temperature": 1e300}}),
        ("/generate", {"inputs": "x", "parameters": {"temperature": 1e-300}}),
        ("/generate", {"inputs": "x", "parameters": {"typical_p": 1e-300, "repetition_penalty": 1e300}}),
        ("/generate", {"inputs": "x", "parameters": {"top_p": 1e-45, "top_k": 2**33}}),
    ],
)
def test_sampling_values_reach_the_scheduler_as_the_replicas_accept_them(
    server: tuple[str, FakeScheduler], path: str, body: dict[str, Any]
) -> None:
    """Was: passed through as given; after the 32-bit conversion the replica refuses them
    (INVALID_ARGUMENT), which fails every request of the batch, other clients' too."""
    answer = post(server, path, body)
    assert answer.status_code == 200, answer.text
    (req,) = server[1].submitted
    assert replica_accepts(req.sampling), req.sampling


def test_truncate_sent_on_fits_the_wire(server: tuple[str, FakeScheduler]) -> None:
    """Was: `truncate` forwarded as given; past 2^32 it cannot be put into the replica's request."""
    answer = post(server, "/generate", {"inputs": "hello world", "parameters": {"truncate": 2**40}})
    assert answer.status_code == 200, answer.text
    (req,) = server[1].submitted
    assert req.truncate is not None and req.truncate <= len(req.input_ids)


def test_tiny_temperature_is_greedy(server: tuple[str, FakeScheduler]) -> None:
    for path, body in (("/v1/completions", {"prompt": "x", "temperature": 1e-9}),
                       ("/generate", {"inputs": "x", "parameters": {"temperature": 1e-9}})):
        assert post(server, path, body).status_code == 200
        assert server[1].submitted[0].sampling.do_sample is False
