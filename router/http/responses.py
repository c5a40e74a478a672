"""JSON responses of the front end (compact, non-ASCII kept as is)."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # built once, not per call


def dumps(obj: Any) -> str:
    """Compact JSON text (non-ASCII kept as is)."""
    return _ENCODER.encode(obj)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response from a plain object."""
    return Response(dumps(obj), status_code=status, media_type="application/json", headers=headers)
