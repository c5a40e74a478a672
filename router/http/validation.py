"""From a parsed request body to a `GenerateRequest`: limits, defaults and what is not supported.

Every refusal is an `APIError` (HTTP 4xx) raised before anything reaches the scheduler.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from router.http.errors import APIError, Flavor, from_validation_error
from router.http.info import ServingInfo
from router.http.schemas import TGIParameters, _OpenAISampling
from router.types import GenerateRequest, Grammar, SamplingParams, StoppingParams

Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, schema: type[Body], flavor: Flavor, ignore_unknown: bool = False) -> Body:
    """Parse and type-check a JSON body; malformed JSON, wrong types and unknown fields become 400s
    naming the field. With `ignore_unknown`, fields the models do not name are dropped instead
    (the router's `--ignore-unknown-fields`); every other complaint stays a 400."""
    if not raw.strip():
        raise APIError("empty request body: expected a JSON object", 400, flavor, code="invalid_json")
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        unknown = [e["loc"] for e in exc.errors(include_url=False) if e["type"] == "extra_forbidden"]
        if not (ignore_unknown and unknown):
            raise from_validation_error(exc, flavor) from exc
    data = json.loads(raw)  # valid JSON: pydantic got as far as the fields
    for loc in unknown:
        _drop(data, loc)
    try:
        return schema.model_validate_json(json.dumps(data))
    except ValidationError as exc:
        raise from_validation_error(exc, flavor) from exc


def _drop(data: object, loc: tuple[int | str, ...]) -> None:
    """Delete the field at pydantic's `loc` (union member tags in it, which are no keys, skipped)."""
    node = data
    for part in loc[:-1]:
        in_dict = isinstance(node, dict) and isinstance(part, str) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            node = node[part]  # type: ignore[index]
    if isinstance(node, dict) and isinstance(loc[-1], str):
        node.pop(loc[-1], None)


def check_model(name: str | None, info: ServingInfo, flavor: Flavor = Flavor.OPENAI) -> None:
    """The OpenAI `model` field must name the served model (absent means the served one)."""
    if name is not None and name != info.model_id:
        raise APIError(
            f"The model `{name}` does not exist; this server serves `{info.model_id}`.",
            404,
            flavor,
            param="model",
            code="model_not_found",
        )


def check_openai_unsupported(body: _OpenAISampling) -> None:
    """Refuse OpenAI features the replicas cannot honour instead of silently ignoring them."""
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed when stream is true", 400, param="stream_options")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI: every bias in [-100, 100]


def openai_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI `logit_bias` ({"token id": bias}) as sorted (id, bias) pairs; a key that is not a token
    id of this vocabulary, or a bias outside [-100, 100], is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", 400, param="logit_bias")
        token = int(key)
        if token >= vocab_size:
            problem = f"token id {token} is outside the vocabulary of {vocab_size}"
            raise APIError(f"logit_bias {problem}", 400, param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails this too
            problem = f"values must be in [-100, 100], got {value} for token {token}"
            raise APIError(f"logit_bias {problem}", 400, param="logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


# The replicas get sampling values as 32-bit floats and top_k as a 32-bit count, and refuse a
# zero or infinite temperature / top_p / typical_p / repetition_penalty: a refusal fails the whole
# batch, other clients' requests included. Values the schema admits are brought into that range
# here without changing what they mean.
GREEDY_BELOW = 1e-5  # a temperature under this samples like greedy decoding (vLLM's epsilon)
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38  # smallest normal 32-bit float


def _f32(value: float) -> float:
    """`value` (> 0) within the positive normal 32-bit floats."""
    return min(max(value, F32_TINY), F32_MAX)


def _top_k(top_k: int | None, vocab_size: int) -> int:
    """0 = off; keeping the whole vocabulary or more is off too."""
    return top_k if top_k is not None and 0 < top_k < vocab_size else 0


def openai_sampling(body: _OpenAISampling, vocab_size: int) -> SamplingParams:
    """OpenAI semantics: temperature defaults to 1 (sampling); temperature 0 means greedy."""
    temperature = 1.0 if body.temperature is None else body.temperature
    greedy = temperature < GREEDY_BELOW
    return SamplingParams(
        temperature=1.0 if greedy else temperature,
        top_k=0 if greedy else _top_k(body.top_k, vocab_size),
        top_p=1.0 if greedy or body.top_p is None else _f32(body.top_p),
        do_sample=not greedy,
        seed=body.seed,
        repetition_penalty=_f32(body.repetition_penalty or 1.0),
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=openai_logit_bias(body.logit_bias, vocab_size),
    )


def tgi_sampling(params: TGIParameters, vocab_size: int) -> SamplingParams:
    """TGI semantics: greedy unless `do_sample` or a warper (temperature, top-k/p, typical-p) is set."""
    temperature = params.temperature if params.temperature is not None else 1.0
    top_k = params.top_k or 0
    top_p = params.top_p if params.top_p is not None else 1.0
    typical_p = params.typical_p if params.typical_p is not None else 1.0
    warped = temperature != 1.0 or top_k != 0 or top_p < 1.0 or typical_p < 1.0
    greedy = temperature < GREEDY_BELOW or not (params.do_sample or warped)
    return SamplingParams(
        temperature=1.0 if greedy else _f32(temperature),
        top_k=0 if greedy else _top_k(top_k, vocab_size),
        top_p=1.0 if greedy else _f32(top_p),
        typical_p=1.0 if greedy else _f32(typical_p),
        do_sample=not greedy,
        seed=params.seed,
        repetition_penalty=_f32(params.repetition_penalty or 1.0),
        frequency_penalty=params.frequency_penalty or 0.0,
        presence_penalty=params.presence_penalty or 0.0,
    )


def check_tgi_unsupported(params: TGIParameters, info: ServingInfo) -> None:
    """Refuse TGI features the replicas cannot honour."""
    if params.best_of not in (None, 1):
        raise APIError("best_of > 1 is not supported", 400, Flavor.TGI)
    if params.watermark:
        raise APIError("watermark is not supported", 400, Flavor.TGI)
    top_n = params.top_n_tokens or 0
    if top_n > info.max_top_n_tokens:
        raise APIError(f"top_n_tokens must be <= {info.max_top_n_tokens}", 400, Flavor.TGI)


def stop_sequences(stop: str | Sequence[str] | None, info: ServingInfo, flavor: Flavor) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings, at most `info.max_stop_sequences` of them."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > info.max_stop_sequences:
        raise APIError(f"at most {info.max_stop_sequences} stop sequences are allowed", 400, flavor, "stop")
    if any(not s for s in stops):
        raise APIError("stop sequences must not be empty strings", 400, flavor, "stop")
    return stops


def check_prompt(
    ids: Sequence[int], info: ServingInfo, vocab_size: int, flavor: Flavor, param: str = "prompt"
) -> tuple[int, ...]:
    """A non-empty prompt of known token ids within `max_input_tokens`."""
    if not ids:
        raise APIError("the prompt is empty", 400, flavor, param)
    if any(not 0 <= t < vocab_size for t in ids):
        raise APIError(f"prompt token ids must be in [0, {vocab_size})", 400, flavor, param)
    if len(ids) > info.max_input_tokens:
        raise APIError(
            f"the prompt has {len(ids)} tokens, over the limit of {info.max_input_tokens} input tokens",
            400,
            flavor,
            param,
            "context_length_exceeded",
        )
    return tuple(ids)


def check_min_tokens(min_tokens: int, max_new: int, flavor: Flavor = Flavor.OPENAI) -> int:
    """`min_tokens` (vLLM's extension: no EOS, no stop sequence before it) within the request's maximum."""
    if min_tokens > max_new:
        problem = f"`min_tokens` ({min_tokens}) must be <= the request's maximum of new tokens ({max_new})"
        raise APIError(problem, 400, flavor, "min_tokens")
    return min_tokens


def check_max_new_range(requested: int | None, info: ServingInfo, flavor: Flavor, param: str) -> None:
    """A maximum of new tokens within what any prompt could leave room for: [1, max_total_tokens - 1]."""
    if requested is not None and not 1 <= requested < info.max_total_tokens:
        raise APIError(f"`{param}` must be in [1, {info.max_total_tokens - 1}]", 400, flavor, param)


def max_new_tokens(
    requested: int | None, default: int, num_input: int, info: ServingInfo, flavor: Flavor, param: str
) -> int:
    """The number of tokens to generate: asked for (checked) or the default capped by the total budget."""
    room = info.max_total_tokens - num_input
    if requested is None:
        if room < 1:
            raise APIError(
                f"the prompt has {num_input} tokens and leaves no room to generate within "
                f"{info.max_total_tokens} total tokens",
                400,
                flavor,
                param,
                "context_length_exceeded",
            )
        return min(default, room)
    if requested < 1:
        raise APIError(f"`{param}` must be at least 1", 400, flavor, param)
    if requested > room:
        raise APIError(
            f"prompt tokens ({num_input}) + `{param}` ({requested}) must be <= {info.max_total_tokens}",
            400,
            flavor,
            param,
            "context_length_exceeded",
        )
    return requested


def generate_request(
    ids: tuple[int, ...],
    sampling: SamplingParams,
    stopping: StoppingParams,
    prefill_logprobs: bool = False,
    top_n_tokens: int = 0,
    truncate: int | None = None,
    grammar: Grammar | None = None,
) -> GenerateRequest:
    """Assemble the scheduler's request (everything already validated)."""
    return GenerateRequest(
        input_ids=ids,
        sampling=sampling,
        stopping=stopping,
        prefill_logprobs=prefill_logprobs,
        top_n_tokens=top_n_tokens,
        truncate=truncate,
        grammar=grammar,
    )
