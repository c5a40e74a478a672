"""`bench serving --url` and an experiment's endpoint cell against a server shaped like vLLM's: no TGI
/info (404), `max_model_len` in /v1/models, the last token in the chunk with the finish reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdcluster.bench.serving.bench import BenchServingConfig, run
from pdcluster.bench.serving.sender import probe
from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment
from tests.helpers.router_http import serve


def vllm_like(received: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 64}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        received.append(body)

        async def chunks() -> AsyncIterator[str]:
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(0.002)
                choice = {"index": 0, "text": f"t{i}", "logprobs": {"tokens": [f"t{i}"]},
                          "finish_reason": "length" if i == n - 1 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_probe_reads_max_model_len_when_there_is_no_info() -> None:
    with serve(vllm_like([])) as url:
        served = probe(url, vocab_size=100)
    assert (served.model_id, served.max_total_tokens, served.max_input_tokens, served.vocab_size) == (
        "tiny", 64, 63, 100)


def test_bench_serving_runs_against_a_server_without_info(tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []
    out = tmp_path / "serving.json"
    with serve(vllm_like(received)) as url:
        config = BenchServingConfig(url=url, num=4, input_len=40, output_len=40, vocab_size=100, json=out,
                                    in_process=False)
        assert run(config) == 0
    assert [len(b["prompt"]) for b in received] == [40] * 4
    assert all(b["max_tokens"] == 24 for b in received)  # clipped to max_model_len 64
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["total_output_tokens"]) == (4, 96)


def test_an_endpoint_cell_in_an_experiment(tmp_path: Path, tiny_llama: Path) -> None:
    received: list[dict[str, Any]] = []
    with serve(vllm_like(received)) as url:
        path = tmp_path / "e.toml"
        path.write_text(f"""
[model]
path = "{tiny_llama}"
[slo]
ttft_ms = 10000
[[workloads]]
name = "w"
rate = 50.0
num = 5
input_len = 10
output_len = 5
[[endpoints]]
name = "stub"
url = "{url}"
[[endpoints]]
name = "absent"
url = "http://127.0.0.1:{{port}}"
launch = ["/nonexistent/python", "-m", "server"]
requires = ["/nonexistent/python"]
""")
        result = run_experiment(load_experiment(path), tmp_path / "out")
    assert {k: o.state for k, o in result.ran.items()} == {"stub__w__r0": "done", "absent__w__r0": "skipped"}
    assert "/nonexistent/python" in result.ran["absent__w__r0"].error
    lines = (tmp_path / "out" / "cells" / "stub__w__r0" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["output_len"] == 5 for line in lines)
    assert "| absent__w__r0 | skipped |" in (tmp_path / "out" / "report.md").read_text()
