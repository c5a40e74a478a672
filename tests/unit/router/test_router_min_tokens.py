"""min_tokens in the router: a continuation is sent the minimum that is left, and the HTTP route
refuses a minimum over the maximum (naming `min_tokens`) and never defaults the maximum below it."""

from __future__ import annotations

from pathlib import Path

from starlette.testclient import TestClient

from router.http import ServingInfo, create_app
from router.requests import RequestState
from router.tokenizer import Tokenizer
from router.types import GenerateRequest, RequestId, SamplingParams, StoppingParams
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import write_word_tokenizer


class _Decoder:
    def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
        return ""


def test_a_continuation_is_sent_the_minimum_left() -> None:
    request = GenerateRequest((1, 2, 3), SamplingParams(), StoppingParams(10, ("x",), False, 4))
    state = RequestState(RequestId(1), request, lambda: 0.0, _Decoder())
    assert state.current().stopping == request.stopping
    state.generated += [7, 8, 9]
    assert state.current().stopping == StoppingParams(7, ("x",), False, 1)
    state.generated += [7, 8]
    assert state.current().stopping.min_new_tokens == 0


def test_min_tokens_through_the_routes(tmp_path: Path) -> None:
    scheduler = FakeScheduler()
    info = ServingInfo(model_id="m", max_input_tokens=16, max_total_tokens=40, default_max_new_tokens=8)
    app = create_app(
        scheduler, Tokenizer.from_model_dir(write_word_tokenizer(tmp_path)), info, lambda: (b"", "text/plain")
    )
    http = TestClient(app)
    refused = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "min_tokens": 3})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "min_tokens")
    too_many = http.post("/v1/completions", json={"prompt": "hello", "min_tokens": 39})
    assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "min_tokens")
    chat = {"messages": [{"role": "user", "content": "hello"}], "min_tokens": 20}
    answer = http.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 20
    assert scheduler.submitted[-1].stopping.min_new_tokens == 20  # the default maximum (8) rose to it
    http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "min_tokens": 2, "stop": ["w1"]})
    assert (
        scheduler.submitted[-1].stopping.max_new_tokens,
        scheduler.submitted[-1].stopping.min_new_tokens,
    ) == (5, 2)
