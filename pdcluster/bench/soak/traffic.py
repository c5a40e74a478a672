"""The soak's clients: a mix of what real clients send, each request's outcome with its times.

OpenAI completions and chat, TGI generate and generate_stream; streamed or not; greedy or seeded
sampling, penalties, stop sequences; some clients hang up mid-stream (`abandoned`); some requests
are malformed and must be refused with a 4xx (`refused`). Anything else that does not end with a
finish is `failed`, with what the client saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

MALFORMED: list[dict[str, Any]] = [
    {"prompt": "x", "temperature": -1},
    {"prompt": "", "max_tokens": 3},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "logit_bias": {"zz": 1}},
    {"prompt": [999999]},
    {"prompt": "x", "top_p": 2},
]
KINDS = ["completion", "completion", "chat", "tgi", "tgi_stream", "malformed"]


@dataclass(frozen=True)
class Planned:
    """One request to send: which API, its body, streamed or not, after how many events to hang up."""

    kind: str
    path: str
    body: dict[str, Any]
    stream: bool
    hang_up: int | None


@dataclass(frozen=True)
class Outcome:
    """What the client saw: `finished`, `abandoned`, `refused` or `failed` (with `detail`)."""

    kind: str
    start: float  # monotonic seconds
    end: float
    outcome: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        """A plain dict for the report."""
        return asdict(self)


def _sampling(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": 0}
    if rng.random() < 0.5:
        out = {"temperature": rng.choice([0.5, 1.0]), "seed": rng.randrange(1, 1000)}
    if rng.random() < 0.3:
        out["frequency_penalty"] = rng.choice([0.5, 1.5])
    if rng.random() < 0.3:
        out["stop"] = rng.sample(["e", "th", " a", "xyz", "."], rng.randint(1, 2))
    return out


def prompt_ids(rng: random.Random, vocab_size: int) -> list[int]:
    """A token-id prompt inside the served vocabulary (ids 3..499 where it is that large: past the
    usual special tokens)."""
    if vocab_size <= 0:
        raise ValueError(f"the served vocabulary size must be > 0, got {vocab_size}")
    low, high = (3, min(vocab_size, 500)) if vocab_size > 3 else (0, vocab_size)
    return [rng.randrange(low, high) for _ in range(rng.randint(1, 120))]


def plan(rng: random.Random, model: str, vocab_size: int) -> Planned:
    """One random request of the mix (token-id prompts drawn below `vocab_size`)."""
    kind = rng.choice(KINDS)
    stream = rng.random() < 0.7
    length = rng.choice([1, 2, rng.randint(3, 40)])  # often done at or right after the prefill
    if kind == "malformed":
        return Planned(kind, "/v1/completions", {"model": model, **rng.choice(MALFORMED)}, False, None)
    if kind in ("completion", "chat"):
        body: dict[str, Any] = {"model": model, "max_tokens": length, "stream": stream, **_sampling(rng)}
        if kind == "completion":
            body["prompt"] = prompt_ids(rng, vocab_size)
        else:
            body["messages"] = [{"role": "user", "content": "tell me " * rng.randint(1, 25)}]
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    else:
        sampling = _sampling(rng)
        params: dict[str, Any] = {"max_new_tokens": length, "details": True}
        if sampling["temperature"]:
            params.update(do_sample=True, temperature=sampling["temperature"], seed=sampling["seed"])
        if "stop" in sampling:
            params["stop"] = sampling["stop"]
        body = {"inputs": "once upon " * rng.randint(1, 30), "parameters": params}
        stream = kind == "tgi_stream"
        path = "/generate_stream" if stream else "/generate"
    hang_up = rng.randint(0, 6) if stream and rng.random() < 0.15 else None
    return Planned(kind, path, body, stream, hang_up)


async def send(client: httpx.AsyncClient, req: Planned) -> tuple[str, str]:
    """Send one request; (outcome, detail)."""
    if not req.stream:
        answer = await client.post(req.path, json=req.body)
        if req.kind == "malformed":
            ok = 400 <= answer.status_code < 500
            return ("refused", "") if ok else ("failed", f"malformed got {answer.status_code}")
        if answer.status_code == 200:
            return "finished", ""
        return "failed", f"{answer.status_code} {answer.text[:300]}"
    async with client.stream("POST", req.path, json=req.body) as answer:
        if answer.status_code != 200:
            return "failed", f"{answer.status_code} {(await answer.aread())[:300]!r}"
        events, finished = 0, False
        async for line in answer.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return "failed", f"stream error {chunk}"
            if req.kind == "tgi_stream":
                finished = finished or chunk.get("generated_text") is not None
            else:
                finished = finished or bool(chunk.get("choices") and chunk["choices"][0].get("finish_reason"))
            events += 1
            if req.hang_up is not None and events >= req.hang_up:
                return "abandoned", ""
        return ("finished", "") if finished else ("failed", "the stream ended without a finish")


async def client_loop(url: str, model: str, vocab_size: int, seed: int, until: float, out: list[Outcome],
                      pause: float = 0.5) -> None:
    """Send random requests one after another (a random pause between them) until `until` (monotonic)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        while time.monotonic() < until:
            req = plan(rng, model, vocab_size)
            start = time.monotonic()
            try:
                outcome, detail = await send(client, req)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                outcome, detail = "failed", f"{type(exc).__name__}: {exc}"
            out.append(Outcome(req.kind, start, time.monotonic(), outcome, detail))
            await asyncio.sleep(rng.random() * pause * 2)
