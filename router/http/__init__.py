"""The router's HTTP front end: OpenAI- and TGI-compatible routes over a `Scheduler` (see README.md)."""

from router.http.app import create_app
from router.http.info import ServingInfo

__all__ = ["ServingInfo", "create_app"]
