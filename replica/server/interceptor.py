"""One mapping from the replica's typed errors to precise gRPC status codes (`guard`).

A `ReplicaError` becomes its own status with its message (and, when another replica caused it,
the trailing metadata `x-pdcluster-cause: peer`); anything else is a bug of ours and becomes
INTERNAL with the exception's type and message (and a logged traceback). Every handler of the
edge (`rpcs.py`) is wrapped in it, in either placement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from replica.errors import CAUSE_KEY, ReplicaError, Status

log = logging.getLogger(__name__)

CODES: dict[Status, grpc.StatusCode] = {status: getattr(grpc.StatusCode, status.value) for status in Status}


def guard(inner: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
    """`inner` with its errors turned into statuses: a ReplicaError's own, anything else INTERNAL."""

    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return inner(request, context)
        except ReplicaError as exc:
            if exc.cause is not None:
                context.set_trailing_metadata(((CAUSE_KEY, exc.cause),))
            context.abort(CODES[exc.status], str(exc) or type(exc).__name__)
        except Exception as exc:
            log.exception("unexpected error in a gRPC handler")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return handler
