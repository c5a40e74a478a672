"""Errors the front end answers with, in the flavour of the API that was called.

OpenAI routes answer ``{"error": {"message", "type", "param", "code"}}``; TGI routes answer
``{"error": message, "error_type": type}`` (what the `text-generation` client parses).
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import ValidationError


class Flavor(enum.Enum):
    """Which API's error shape a route uses."""

    OPENAI = "openai"
    TGI = "tgi"


_OPENAI_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
_TGI_TYPES = {
    400: "validation",
    401: "authentication",
    404: "validation",
    422: "validation",
    429: "overloaded",
}


class APIError(Exception):
    """A request-level failure with its HTTP status; rendered by the app's exception handler."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        flavor: Flavor = Flavor.OPENAI,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.flavor = flavor
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429, WWW-Authenticate on a 401

    def body(self) -> dict[str, Any]:
        """The JSON body of this error in its route's flavour."""
        return error_body(self.message, self.status, self.flavor, self.param, self.code)


def error_body(
    message: str, status: int, flavor: Flavor, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An error body; also used for the SSE error event sent when a stream fails midway."""
    if flavor is Flavor.TGI:
        error_type = _TGI_TYPES.get(status, "generation" if status >= 500 else "validation")
        return {"error": message, "error_type": error_type}
    error_kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_kind, "param": param, "code": code}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "TextPart"})


def _is_union_tag(part: object) -> bool:
    """pydantic adds the union member tried (`str`, `list[int]`, ...) to an error's location."""
    text = str(part)
    return text in _TYPE_TAGS or any(c in text for c in "[-")


def from_validation_error(exc: ValidationError, flavor: Flavor) -> APIError:
    """The first pydantic complaint as a 400 naming the offending field."""
    errors = exc.errors(include_url=False)
    # An unknown field is the complaint to name: a union's other members fail for its sake only.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = ".".join(str(part) for part in first.get("loc", ()) if not _is_union_tag(part))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return APIError(f"malformed JSON body: {first.get('msg', '')}", 400, flavor, code="invalid_json")
    where = f"`{loc}`: " if loc else ""
    if kind == "extra_forbidden":
        message = (
            f"{where}unknown field: this server refuses what it cannot honour "
            "(the router's --ignore-unknown-fields drops such fields instead)"
        )
        return APIError(message, 400, flavor, param=loc or None, code="unknown_field")
    return APIError(f"{where}{first.get('msg', 'invalid value')}", 400, flavor, param=loc or None, code=kind)
