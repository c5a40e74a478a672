"""The fake replica's one error: a refusal with the status a real replica answers."""

from __future__ import annotations

import grpc


class Refused(Exception):
    """A call the fake refuses, as a real replica would (code and reason)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
