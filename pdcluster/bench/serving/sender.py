"""Send a workload to an OpenAI-compatible server and time every token: the part `bench serving` and the
experiment harness share.

```
 probe(url) ── GET /v1/models (model id; vLLM: max_model_len) ── GET /info (TGI, pdcluster: limits,
      │                                                            vocabulary; a 404 elsewhere is fine)
 send_all(url, model, arrivals, prompts) ── one task per request, each sent at its arrival time
      └──► [RequestRecord] (client.stream_completion times each streamed token)
```
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdcluster.bench.serving.client import get_json, stream_completion
from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.bench.serving.workload import Arrival


@dataclass(frozen=True)
class Served:
    """What the server says about its model (and what the caller had to add)."""

    model_id: str
    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int


def model_vocab_size(model: Path | None) -> int:
    """`vocab_size` of a checkpoint's config.json (0 when unknown)."""
    if model is None or not (model / "config.json").is_file():
        return 0
    return int(json.loads((model / "config.json").read_text()).get("vocab_size") or 0)


def probe(url: str, max_model_len: int = 0, vocab_size: int = 0) -> Served:
    """The served model of the OpenAI server at `url`.

    Limits come from TGI's `/info` where the server has it (pdcluster, TGI), else from `/v1/models`'
    `max_model_len` (vLLM, SGLang), else from `max_model_len`; the vocabulary from `/info`, else
    `vocab_size` (prompts are token ids below it). Raises ValueError when a number is known nowhere.
    """
    model = get_json(f"{url}/v1/models")["data"][0]
    info = _info(url)
    total = int(info.get("max_total_tokens") or model.get("max_model_len") or max_model_len)
    if total < 2:
        raise ValueError(f"{url} tells no context length (no /info, no max_model_len): give max_model_len")
    vocab = int(info.get("vocab_size") or vocab_size)
    if vocab < 4:
        raise ValueError(f"{url} tells no vocabulary size: give the model folder or vocab_size")
    return Served(str(model["id"]), int(info.get("max_input_tokens") or total - 1), total, vocab)


def _info(url: str) -> dict:
    try:
        info = get_json(f"{url}/info")
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 405):  # not a TGI-style server: /v1/models is all there is
            return {}
        raise
    return info if isinstance(info, dict) else {}


async def send_all(
    url: str, model: str, arrivals: Sequence[Arrival], prompts: Sequence[list[int]], timeout: float,
    progress: Callable[[list[asyncio.Task[RequestRecord]]], None] | None = None, start: float = 0.0,
) -> tuple[list[RequestRecord], float, float]:
    """Send each request at its arrival time; (records, seconds from the start to the last answer, the
    `time.perf_counter()` the arrival times count from: `start`, or now). `progress` is called every
    second."""
    start = start or time.perf_counter()
    tasks = [asyncio.create_task(_one(url, model, i, a, prompts[i], start, timeout))
             for i, a in enumerate(arrivals)]
    reporter = asyncio.create_task(_report(tasks, progress)) if progress else None
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if reporter is not None:
        reporter.cancel()
    return list(records), duration, start


async def _report(tasks: list[asyncio.Task[RequestRecord]],
                  progress: Callable[[list[asyncio.Task[RequestRecord]]], None]) -> None:
    while True:
        await asyncio.sleep(1.0)
        progress(tasks)


async def warm_up(url: str, model: str, prompt: list[int], timeout: float) -> RequestRecord:
    """One short request before the measured ones, as vLLM's benchmark sends its test prompt: a
    server's first request pays its lazy start-up (compilation, allocation), which no measured
    request should."""
    record = await _one(url, model, -1, Arrival(0.0, len(prompt), 2), prompt, time.perf_counter(), timeout)
    if not record.success:
        raise RuntimeError(f"the warm-up request failed: {record.error}")
    return record


async def _one(
    url: str, model: str, index: int, arrival: Arrival, prompt: list[int], t0: float, timeout: float
) -> RequestRecord:
    """Send one streamed completion at its arrival time and time every token (within `timeout` s)."""
    await asyncio.sleep(max(0.0, t0 + arrival.at - time.perf_counter()))
    record = RequestRecord(index=index, input_len=arrival.input_len, scheduled=arrival.at,
                           start=time.perf_counter() - t0)
    body = {
        "model": arrival.model or model,  # a request of a several-model workload names its model
        "prompt": prompt,
        "max_tokens": arrival.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,  # every token its own chunk, even one without text: ITL is per token
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        await asyncio.wait_for(stream_completion(url, body, record), timeout)
    except TimeoutError:
        record.success = False
        record.error = f"no answer within {timeout} s"
    except Exception as exc:  # a failed request is a data point, not the end of the run
        record.error = f"{type(exc).__name__}: {exc}"
    return record
