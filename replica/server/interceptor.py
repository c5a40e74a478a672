"""One interceptor maps the replica's typed errors to precise gRPC status codes.

A `ReplicaError` becomes its own status with its message (and, when another replica caused it,
the trailing metadata `x-pdcluster-cause: peer`); anything else is a bug of ours and becomes
INTERNAL with the exception's type and message (and a logged traceback).
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
    """`inner` with its errors turned into statuses: a ReplicaError's own (or the gRPC code it carries,
    `grpc_code`, for a failure passed on from another server), anything else INTERNAL."""

    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return inner(request, context)
        except ReplicaError as exc:
            code = getattr(exc, "grpc_code", None) or CODES[exc.status]
            if exc.cause is not None:
                context.set_trailing_metadata(((CAUSE_KEY, exc.cause),))
            context.abort(code, str(exc) or type(exc).__name__)
        except Exception as exc:
            log.exception("unexpected error in a gRPC handler")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps every unary-unary handler; streaming handlers (health Watch, reflection) pass through."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            guard(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
