"""The router's Prometheus metrics, on its own `CollectorRegistry` (no global state).

`render()` returns the exposition body and its content type; the front end serves it at `/metrics`.
Request, queue, migration and scaling series carry a `model` label: each model's scheduler writes
through its own view (`for_model(name)`), which shares the collectors and the registry.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.replicas import ReplicaState, State

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))


class RouterMetrics:
    """Counters, gauges and histograms of one router process; `model`: the label this view writes
    (`for_model`), "" for the router-wide view."""

    def __init__(self) -> None:
        self.model = ""
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]
        self.queue_depth = Gauge("pdcluster_queue_depth", "Requests waiting for a prefill", m, registry=r)
        self.queue_tokens = Gauge("pdcluster_queue_prompt_tokens", "Prompt tokens waiting", m, registry=r)
        self.ttft = Histogram("pdcluster_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdcluster_time_per_output_token_seconds", "Mean time per output token after "
                              "the first", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdcluster_e2e_request_latency_seconds", "Submit to last token", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdcluster_requests", "Requests by outcome", ["outcome", "model"], registry=r)
        self.prompt_tokens = Counter("pdcluster_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model"], registry=r)
        self.generated_tokens = Counter("pdcluster_generated_tokens", "Tokens generated", m, registry=r)
        self.migrations = Counter("pdcluster_migrations", "Batches moved to a decode replica",
                                  ["strategy", "model"], registry=r)
        self.migration_bytes = Counter("pdcluster_migration_bytes", "Bytes moved by migrations",
                                       ["strategy", "model"], registry=r)
        self.migration_seconds = Histogram("pdcluster_migration_seconds", "Time of one batch migration",
                                           ["strategy", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.migration_size = Histogram("pdcluster_migration_batch_bytes", "Bytes of one batch migration",
                                        ["model"], buckets=_BYTES_BUCKETS, registry=r)
        self.requeued = Counter("pdcluster_requests_requeued", "Requests re-run after a replica died",
                                ["model"], registry=r)
        self.replica_state = Gauge("pdcluster_replica_state", "1 for the replica's current role",
                                   ["replica", "address", "role"], registry=r)
        self.replica_free = Gauge("pdcluster_replica_free_blocks", "Free KV pages reported by the replica",
                                  ["replica"], registry=r)
        self.replica_used = Gauge("pdcluster_replica_router_used_blocks", "KV pages the router accounts "
                                  "to the replica's batches", ["replica"], registry=r)
        self.replica_tp = Gauge("pdcluster_replica_tp_size", "Ranks of the replica's tensor-parallel group "
                                "(one replica whatever its size)", ["replica"], registry=r)
        self.replicas_in_state = Gauge("pdcluster_replicas", "Replicas in each state, per model (\"\": the "
                                       "shared spare pool of a router with several models)",
                                       ["state", "model"], registry=r)
        self.prefix_prompt_tokens = Counter("pdcluster_prefix_cache_prompt_tokens", "Prompt tokens prefilled",
                                            ["replica"], registry=r)
        self.prefix_cached_tokens = Counter("pdcluster_prefix_cache_hit_tokens", "Prompt tokens a prefill "
                                            "took from the replica's prefix cache", ["replica"], registry=r)
        self.prefix_hit_rate = Gauge("pdcluster_prefix_cache_hit_rate", "Prompt tokens taken from prefix "
                                     "caches / prompt tokens prefilled, over all replicas", registry=r)
        self._prefix_totals = [0, 0]  # prompt, hit
        self.scaling_actions = Counter("pdcluster_scaling_actions", "Scaling actions by kind and outcome",
                                       ["action", "outcome", "model"], registry=r)

    def for_model(self, model: str) -> RouterMetrics:
        """A view writing model `model`'s series (same collectors, same registry)."""
        view = copy.copy(self)
        view.model = model
        return view

    def total(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The sum of sample `name` over the series whose labels include `labels` (every model's
        when `labels` names none)."""
        want = dict(labels or {})
        return sum(s.value for family in self.registry.collect() for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in want.items()))

    def request_done(self, outcome: str, submitted: float, first: float | None, end: float,
                     prompt: int, generated: int) -> None:
        """One request ended (`outcome`: finished, failed, cancelled)."""
        m = self.model
        self.requests.labels(outcome, m).inc()
        if outcome != "finished":
            return
        self.prompt_tokens.labels(m).inc(prompt)
        self.e2e.labels(m).observe(end - submitted)
        if first is not None:
            self.ttft.labels(m).observe(first - submitted)
            if generated > 1:
                self.tpot.labels(m).observe((end - first) / (generated - 1))

    def generated(self, tokens: int) -> None:
        """`tokens` more tokens delivered (once per step: a prometheus update takes a lock)."""
        self.generated_tokens.labels(self.model).inc(tokens)

    def requeue(self) -> None:
        """One request re-run after its replica died."""
        self.requeued.labels(self.model).inc()

    def queue(self, depth: int, prompt_tokens: int) -> None:
        """The model's prefill queue now."""
        self.queue_depth.labels(self.model).set(depth)
        self.queue_tokens.labels(self.model).set(prompt_tokens)

    def migration(self, strategy: str, nbytes: int, seconds: float) -> None:
        """One batch moved."""
        m = self.model
        self.migrations.labels(strategy, m).inc()
        self.migration_bytes.labels(strategy, m).inc(nbytes)
        self.migration_seconds.labels(strategy, m).observe(seconds)
        self.migration_size.labels(m).observe(nbytes)

    def prefix_cache(self, replica: str, prompt: int, cached: int) -> None:
        """A prefill on `replica` of `prompt` prompt tokens, `cached` of them from its prefix cache."""
        self.prefix_prompt_tokens.labels(replica).inc(prompt)
        self.prefix_cached_tokens.labels(replica).inc(cached)
        self._prefix_totals[0] += prompt
        self._prefix_totals[1] += cached
        if self._prefix_totals[0]:
            self.prefix_hit_rate.set(self._prefix_totals[1] / self._prefix_totals[0])

    def update_replicas(self, replicas: Iterable[ReplicaState]) -> None:
        """Refresh per-replica gauges."""
        for rep in replicas:
            rid = str(rep.id)
            for role in State:
                self.replica_state.labels(rid, rep.address, role.value).set(1 if rep.role is role else 0)
            self.replica_free.labels(rid).set(rep.info.num_blocks_free)
            self.replica_used.labels(rid).set(rep.used_blocks)
            self.replica_tp.labels(rid).set(rep.info.tp_size)

    def count_states(self, states: Iterable[State], model: str = "") -> None:
        """Refresh model `model`'s per-state replica counts (each model writes its own series)."""
        counts = dict.fromkeys(State, 0)
        for state in states:
            counts[state] += 1
        for state, n in counts.items():
            self.replicas_in_state.labels(state.value, model).set(n)

    def scaling_action(self, action: str, ok: bool) -> None:
        """A scaling action ended."""
        self.scaling_actions.labels(action, "ok" if ok else "failed", self.model).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
