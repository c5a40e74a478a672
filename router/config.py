"""`RouterConfig`: the one config of the router process; `pdcluster router`'s flags are its fields.

Imports neither grpc nor torch (it loads for `--help`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from router import strategies
from router.models import ModelSpec, parse_model
from router.scaling import policies
from router.scaling.planner import Bounds
from router.security import RouterTls, read_token
from router.strategies import Strategy

__all__ = ["ROLE_NAMES", "RouterConfig", "Strategy"]

ROLE_NAMES = ("prefill", "decode", "colocated", "inactive")
_BOUNDS = Bounds()  # the planner's defaults


def _help(text: str, **extra: object) -> dict[str, object]:
    return {"help": text, **extra}


@dataclass
class RouterConfig:
    """Flags of `pdcluster router`."""

    model: Path = field(metadata=_help("checkpoint folder (tokenizer, config.json)"))
    replica: list[str] = field(default_factory=list, metadata=_help("replica gRPC addresses HOST:PORT"))
    role: list[str] = field(default_factory=list, metadata=_help(
        "role of each --replica, same order (prefill|decode|colocated|inactive); default: the first "
        "is prefill and the others decode, or colocated when there is one replica"))
    host: str = field(default="127.0.0.1", metadata=_help("address the HTTP and admin servers bind"))
    http_port: int = field(default=8080, metadata=_help("HTTP port (0 = pick a free one)"))
    admin_port: int = field(default=50100, metadata=_help("admin gRPC port (0 = pick a free one)"))
    strategy: str = field(default=Strategy.FULL.value, metadata=_help(
        "migration strategy: a name registered in router/strategies/ (built in: "
        + ", ".join(s.value for s in Strategy) + ")"))
    routing: str = field(default="cache-aware", metadata=_help(
        "which replica prefills a prompt: cache-aware (the one holding the longest cached prefix of "
        "it, unless its load is more than --routing-max-load over the least loaded's; else the "
        "least loaded) or load (the least loaded, the cache ignored)"))
    routing_max_load: int = field(default=4, metadata=_help(
        "cache-aware routing: a replica holding a prompt's prefix is passed over while it holds "
        "pages for more than this many requests over the least loaded replica"))
    admin_token: str = field(default="", metadata=_help(
        "token required in the `x-admin-token` metadata of mutating admin calls (empty = none)"))
    api_keys: Path | None = field(default=None, metadata=_help(
        "API key file: one `KEY [name=N] [rpm=N] [concurrent=N] [tpm=N]` per line, # comments "
        "(router/http/README.md); /v1/* and TGI routes then need `Authorization: Bearer KEY` (unset = open)"))
    ignore_unknown_fields: bool = field(default=False, metadata=_help(
        "drop request fields the OpenAI / TGI routes do not know instead of refusing them with a 400 "
        "naming the field (for clients that send extras; known fields it cannot honour stay refused)"))
    tls_cert: Path | None = field(default=None, metadata=_help(
        "PEM certificate: serve HTTPS and admin gRPC over TLS, and present it to replicas "
        "(`pdcluster make-certs`)"))
    tls_key: Path | None = field(default=None, metadata=_help("PEM private key of --tls-cert"))
    tls_ca: Path | None = field(default=None, metadata=_help(
        "PEM CA that signed the replicas' certificates: call replicas over TLS"))
    tls_client_ca: Path | None = field(default=None, metadata=_help(
        "PEM CA: HTTPS and admin clients must present a certificate it signed (mutual TLS)"))
    cluster_token: str = field(default="", metadata=_help(
        "the replicas' cluster token, sent as `x-cluster-token` on every replica call (empty = none)"))
    cluster_token_file: Path | None = field(default=None, metadata=_help(
        "file holding the cluster token (kept out of the process list)"))
    model_id: str = field(default="", metadata=_help("model name served (default: the folder name)"))
    max_batch_prefill_tokens: int = field(default=4096, metadata=_help("prompt tokens per prefill batch"))
    chunked_prefill: bool = field(default=True, metadata=_help(
        "colocated: prefill a batch over --prefill-chunk-tokens in chunks of that size, one per loop "
        "step, with a decode step of the running batch between them (a long prompt does not stall it)"))
    prefill_chunk_tokens: int = field(default=512, metadata=_help(
        "colocated chunked prefill: prompt tokens per chunk, and a batch with more prompt tokens is "
        "chunked (0: --max-batch-prefill-tokens); smaller chunks hold a decode step up less"))
    prefill_chunk_share: float = field(default=0.5, metadata=_help(
        "colocated chunked prefill: the share of the replica's time chunks may take while a batch "
        "decodes (the running requests' TPOT grows by at most 1 / (1 - share)); 1: a chunk every step"))
    max_batch_total_tokens: int = field(default=65536, metadata=_help(
        "prompt + new tokens one prefill batch may reserve"))
    max_batch_size: int = field(default=64, metadata=_help("requests per prefill batch"))
    max_new_tokens: int = field(default=256, metadata=_help("default max new tokens of a request"))
    max_inbound_migrations: int = field(default=2, metadata=_help(
        "migrations in flight into one decode replica"))
    max_pending_migrations: int = field(default=4, metadata=_help(
        "prefilled batches one prefill replica may hold while they wait for a decode replica"))
    max_requeues: int = field(default=3, metadata=_help("times a request is re-run after replica failures"))
    heartbeat_interval: float = field(default=1.0, metadata=_help("seconds between replica liveness checks"))
    heartbeat_timeout: float = field(default=5.0, metadata=_help(
        "seconds without a heartbeat after which a replica is dead"))
    rpc_timeout: float = field(default=60.0, metadata=_help("deadline of replica calls (seconds)"))
    transfer_timeout: float = field(default=300.0, metadata=_help("deadline of migration and weight calls"))
    peer_connect_timeout: float = field(default=60.0, metadata=_help(
        "seconds a joining replica's fabric connections with the others may take (ConnectPeers on both "
        "ends, in the background; 0 = connect on first use instead)"))
    scaling: str = field(default="static", metadata=_help(
        "scaling policy: " + ", ".join(policies.names()) + " (router/scaling/policies.py)"))
    plan_interval: float = field(default=0.25, metadata=_help("seconds between two planning rounds"))
    prefill_lower: float = field(default=_BOUNDS.prefill_lower, metadata=_help(
        "prefill load lower bound: seconds of queued prompt work per prefill replica"))
    prefill_upper: float = field(default=_BOUNDS.prefill_upper, metadata=_help(
        "prefill load upper bound (seconds of queued prompt work per prefill replica)"))
    decode_lower: float = field(default=_BOUNDS.decode_lower, metadata=_help(
        "decode load lower bound: fraction of the decode replicas' KV pages in use"))
    decode_upper: float = field(default=_BOUNDS.decode_upper, metadata=_help(
        "decode load upper bound (fraction of KV pages in use)"))
    migration_upper: float = field(default=_BOUNDS.migration_upper, metadata=_help(
        "seconds of KV waiting for migration per decode replica before decode scales up"))
    min_prefill: int = field(default=_BOUNDS.min_prefill, metadata=_help("fewest prefill replicas"))
    max_prefill: int = field(default=_BOUNDS.max_prefill, metadata=_help("most prefill replicas"))
    min_decode: int = field(default=_BOUNDS.min_decode, metadata=_help("fewest decode replicas"))
    max_decode: int = field(default=_BOUNDS.max_decode, metadata=_help("most decode replicas"))
    cooldown: float = field(default=_BOUNDS.cooldown, metadata=_help(
        "seconds after a kind of replica scaled up during which it does not scale down"))
    keep_alive: float = field(default=_BOUNDS.keep_alive, metadata=_help(
        "seconds a drained replica keeps its weights (idle) before it is reset to inactive"))
    ttft_slo: float = field(default=0.0, metadata=_help(
        "TTFT SLO, seconds (0 = none): prefill scales up, at once between rounds, when the queued prompt "
        "work per prefill replica predicts a TTFT above it"))
    tpot_slo: float = field(default=0.0, metadata=_help(
        "TPOT SLO, seconds (0 = none: decode scales on page use): decode scales on measured TPOT, decode "
        "batch and migration backlog, down only when the smaller cluster stays under --tpot-lower of it "
        "for --cooldown seconds"))
    tpot_lower: float = field(default=_BOUNDS.tpot_lower, metadata=_help(
        "fraction of --tpot-slo the smaller decode cluster's predicted TPOT must stay under to scale down"))
    decode_batch_limit: int = field(default=_BOUNDS.decode_batch_limit, metadata=_help(
        "requests one decode replica may run, for the planner under --tpot-slo"))
    surge_window: float = field(default=0.5, metadata=_help(
        "seconds of arrivals the planner also reads to see a step in load (planned at once when they "
        "outrun the prefill replicas)"))
    prefill_tokens_per_s: float = field(default=0.0, metadata=_help(
        "one replica's prefill speed until measured, tokens/s (0 = wait for the first prefill)"))
    migration_tokens_per_s: float = field(default=0.0, metadata=_help(
        "one decode replica's KV intake until measured, tokens/s (0 = wait for the first migration)"))
    timeline: Path | None = field(default=None, metadata=_help(
        "write the router's timeline here (JSONL: planner rounds, state changes, transfers, relays)"))
    models: list[str] = field(default_factory=list, metadata=_help(
        "more models served beside --model, each NAME=DIR[,min-prefill=N][,min-decode=N][,max-prefill=N]"
        "[,max-decode=N][,keep-alive=S]: a request's `model` picks one; each model has its own replicas "
        "and planner, inactive replicas are shared (router/README.md, several models)"))
    wake_timeout: float = field(default=60.0, metadata=_help(
        "several models: seconds a request for a model no replica serves waits for one to be loaded"))

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        self.strategy = strategies.get(self.strategy).name  # a `Strategy` or a name; unknown → ValueError
        if self.api_keys is not None:
            self.api_keys = Path(self.api_keys)
        if self.routing not in ("cache-aware", "load"):
            raise ValueError(f"--routing must be cache-aware or load, got {self.routing!r}")
        if self.routing_max_load < 0:
            raise ValueError(f"--routing-max-load must be >= 0, got {self.routing_max_load}")
        if self.role and len(self.role) != len(self.replica):
            raise ValueError("--role needs one entry per --replica")
        bad = [r for r in self.role if r not in ROLE_NAMES]
        if bad:
            raise ValueError(f"unknown role(s) {bad}; choose from {ROLE_NAMES}")
        if self.max_inbound_migrations < 1 or self.max_pending_migrations < 1 or self.max_batch_size < 1:
            raise ValueError("migration bounds and batch size must be >= 1")
        if self.peer_connect_timeout < 0:
            raise ValueError(f"peer_connect_timeout must be >= 0, got {self.peer_connect_timeout}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("--prefill-chunk-tokens must be >= 0")
        if not 0.0 < self.prefill_chunk_share <= 1.0:
            raise ValueError(f"--prefill-chunk-share must be in (0, 1], got {self.prefill_chunk_share}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed heartbeat_interval")
        policies.get(self.scaling)  # an unknown name → ValueError naming the known ones
        self.bounds()  # contradicting bounds → ValueError naming them
        if self.plan_interval <= 0:
            raise ValueError(f"--plan-interval must be > 0, got {self.plan_interval}")
        if self.surge_window <= 0:
            raise ValueError(f"--surge-window must be > 0, got {self.surge_window}")
        if self.prefill_tokens_per_s < 0 or self.migration_tokens_per_s < 0:
            raise ValueError("--prefill-tokens-per-s and --migration-tokens-per-s must be >= 0")
        if self.timeline is not None:
            self.timeline = Path(self.timeline)
        self._check_models()
        self._check_security()

    def _check_models(self) -> None:
        specs = self.model_specs()  # a malformed entry → ValueError
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ (--model-id / folder name and --models): {names}")
        for spec in specs:
            spec.bounds(self.bounds())  # contradicting overrides → ValueError
        if self.wake_timeout <= 0:
            raise ValueError(f"--wake-timeout must be > 0, got {self.wake_timeout}")

    def model_specs(self) -> list[ModelSpec]:
        """Every served model: `--model` (named `served_model_id`) first, then `--models`."""
        return [ModelSpec(self.served_model_id, Path(self.model)), *(parse_model(m) for m in self.models)]

    def _check_security(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_ca", "cluster_token_file"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.cluster_token and self.cluster_token_file is not None:
            raise ValueError("give --cluster-token or --cluster-token-file, not both")

    def tls(self) -> RouterTls:
        """The TLS files (ValueError when one does not exist)."""
        return RouterTls(self.tls_cert, self.tls_key, self.tls_ca, self.tls_client_ca)

    def token(self) -> str:
        """The cluster token ('' = none; ValueError for an empty or unusable token file)."""
        return read_token(self.cluster_token, self.cluster_token_file)

    @property
    def chunk_tokens(self) -> int:
        """Prompt tokens per colocated prefill chunk (0: no chunked prefill)."""
        return (self.prefill_chunk_tokens or self.max_batch_prefill_tokens) if self.chunked_prefill else 0

    def bounds(self) -> Bounds:
        """The planner's bounds (validated)."""
        return Bounds(
            prefill_lower=self.prefill_lower, prefill_upper=self.prefill_upper,
            decode_lower=self.decode_lower, decode_upper=self.decode_upper,
            migration_upper=self.migration_upper, min_prefill=self.min_prefill,
            max_prefill=self.max_prefill, min_decode=self.min_decode, max_decode=self.max_decode,
            keep_alive=self.keep_alive, cooldown=self.cooldown, ttft_slo=self.ttft_slo,
            tpot_slo=self.tpot_slo, tpot_lower=self.tpot_lower, decode_batch_limit=self.decode_batch_limit,
        )

    def roles(self) -> list[str]:
        """The role of each `--replica` (explicit or the default split)."""
        if self.role or not self.replica:
            return list(self.role)
        if len(self.replica) == 1:
            return ["colocated"]
        return ["prefill"] + ["decode"] * (len(self.replica) - 1)

    @property
    def served_model_id(self) -> str:
        """The model name clients use."""
        return self.model_id or self.model.name
