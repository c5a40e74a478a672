"""API keys and per-key limits at the HTTP edge (an ASGI middleware), and their metrics.

    request ──► guarded path? (/v1/*, /generate, /generate_stream, POST /)   no ──► app (open)
                  │ Authorization: Bearer KEY  → KeyTable.find (constant time)  ✗ → 401
                  │ RateLimiter.admit: rpm, concurrent                          ✗ → 429 + Retry-After
                  ▼
                app (the lease rides in scope["state"]); generation routes charge tpm in `start`
                  │ the ASGI call returns when the answer is sent, a stream ends or the client leaves
                  ▼
                lease.release(): the concurrency slot frees, the token charge is settled

Open without a key: /health, /metrics, /info, /docs, /openapi.json (and any other path).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.http.errors import APIError, Flavor
from router.http.keys import LIMIT_FIELDS, ApiKey, KeyTable
from router.http.limits import Lease, RateLimiter, Refusal, TooLarge
from router.http.responses import json_response
from router.types import GenerateRequest

TGI_GUARDED = frozenset({"/generate", "/generate_stream", "/"})
LEASE_STATE = "pdcluster_api_key_lease"


def guarded(path: str) -> bool:
    """Whether `path` needs a key when keys are configured."""
    return path in TGI_GUARDED or path == "/v1" or path.startswith("/v1/")


def flavor_of(path: str) -> Flavor:
    """The error shape of a guarded path."""
    return Flavor.TGI if path in TGI_GUARDED else Flavor.OPENAI


def bearer_token(scope: Scope) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


class KeyMetrics:
    """Per-key limits, admissions, rejections, tokens and requests in flight (own registry)."""

    def __init__(self, table: KeyTable) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        limit = Gauge("pdcluster_api_key_limit", "Configured per-key limits (absent = unlimited)",
                      ["key", "limit"], registry=r)
        self.admitted = Counter("pdcluster_api_key_requests", "Requests admitted per key", ["key"],
                                registry=r)
        self.rejected = Counter("pdcluster_api_key_rejections", "Requests refused by a per-key limit "
                                "(reason: rpm, concurrent, tpm, too_large)", ["key", "reason"], registry=r)
        self.unauthorized = Counter("pdcluster_api_unauthorized", "Requests refused 401 (reason: missing, "
                                    "invalid)", ["reason"], registry=r)
        self.in_flight = Gauge("pdcluster_api_key_in_flight", "Requests of a key in flight", ["key"],
                               registry=r)
        self.tokens = Counter("pdcluster_api_key_tokens", "Prompt + completion tokens charged per key "
                              "(settled when a request ends)", ["key"], registry=r)
        for key in table.keys:
            for name in LIMIT_FIELDS:
                value = getattr(key.limits, name)
                if value is not None:
                    limit.labels(key.name, name).set(value)
            self.admitted.labels(key.name)
            self.in_flight.labels(key.name).set(0)

    def render(self) -> bytes:
        """The exposition text of these metrics."""
        return generate_latest(self.registry)


@dataclass(frozen=True)
class Access:
    """Keys, their limiter and metrics: what `create_app(api_keys=...)` installs."""

    table: KeyTable
    limiter: RateLimiter
    metrics: KeyMetrics

    @classmethod
    def from_table(cls, table: KeyTable) -> Access:
        """Fresh limits (nothing used yet) for the keys of `table`."""
        return cls(table, RateLimiter(table), KeyMetrics(table))

    def charge_tokens(self, request: Request, req: GenerateRequest, flavor: Flavor) -> Lease | None:
        """Reserve `req`'s tokens under its key's tpm (None when the request carries no lease)."""
        lease: Lease | None = request.scope.get("state", {}).get(LEASE_STATE)
        if lease is None:
            return None
        result = lease.charge(len(req.input_ids), req.stopping.max_new_tokens)
        if isinstance(result, TooLarge):
            self.metrics.rejected.labels(lease.key.name, "too_large").inc()
            raise APIError(
                f"this request may use {result.needed} tokens (prompt + maximum new tokens), more than "
                f"the {result.limit} tokens per minute of API key `{lease.key.name}`: ask for fewer "
                "new tokens or send a shorter prompt",
                400, flavor, code="tpm_limit_exceeded",
            )
        if isinstance(result, Refusal):
            raise self._refused(lease.key, result, flavor)
        return lease

    def _refused(self, key: ApiKey, refusal: Refusal, flavor: Flavor) -> APIError:
        self.metrics.rejected.labels(key.name, refusal.kind.value).inc()
        return APIError(
            f"rate limit reached for API key `{key.name}`: {refusal.message}; "
            f"retry after {refusal.retry_after} s",
            429, flavor, code=f"{refusal.kind.value}_limit_exceeded",
            headers={"Retry-After": str(refusal.retry_after)},
        )

    def authenticate(self, scope: Scope) -> ApiKey | APIError:
        """The key a guarded request presents, or its 401."""
        flavor = flavor_of(scope["path"])
        presented = bearer_token(scope)
        key = None if presented is None else self.table.find(presented)
        if key is not None:
            return key
        reason = "missing" if presented is None else "invalid"
        self.metrics.unauthorized.labels(reason).inc()
        message = (
            "no API key: send it as `Authorization: Bearer KEY`"
            if presented is None
            else "invalid API key"  # never echo what was presented
        )
        return APIError(message, 401, flavor, code=f"{reason}_api_key",
                        headers={"WWW-Authenticate": 'Bearer realm="pdcluster"'})

    def admit(self, key: ApiKey, flavor: Flavor) -> Lease | APIError:
        """Take a slot for a request of `key`, or its 429."""
        lease = self.limiter.admit(key)
        if isinstance(lease, Refusal):
            return self._refused(key, lease, flavor)
        self.metrics.admitted.labels(key.name).inc()
        self.metrics.in_flight.labels(key.name).set(self.limiter.in_flight(key))
        return lease

    def release(self, lease: Lease) -> None:
        """The request's ASGI call is over: free its slot, count the tokens it used."""
        tokens = lease.release()
        self.metrics.tokens.labels(lease.key.name).inc(tokens)
        self.metrics.in_flight.labels(lease.key.name).set(self.limiter.in_flight(lease.key))


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware): its call lasts exactly as long as the response, stream
    included, so a streamed request holds its concurrency slot until the stream ends or the client
    leaves."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        key = self.access.authenticate(scope)
        lease = key if isinstance(key, APIError) else self.access.admit(key, flavor_of(scope["path"]))
        if isinstance(lease, APIError):
            response = json_response(lease.body(), lease.status, lease.headers)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[LEASE_STATE] = lease
        try:
            await self.app(scope, receive, send)
        finally:
            self.access.release(lease)

