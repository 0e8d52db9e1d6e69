"""Prometheus metrics of the HTTP server: calls, seconds and tokens per operation, process memory.

Each app owns its registry (not prometheus_client's global one), so several servers in one
process (tests, a sidecar) never mix their counts. The per-call numbers come from
``Result.metrics``, the same numbers every response carries.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from arctic_core.protocol import Result

CONTENT_TYPE = CONTENT_TYPE_LATEST
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class CallMetrics:
    """Counters a server updates once per call; :meth:`render` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, ...
        self.calls = Counter("arctic_calls", "Calls per operation and outcome ('ok' or the error class).",
                             ["op", "outcome"], registry=self.registry)
        self.seconds = Histogram("arctic_call_seconds",
                                 "Seconds the server spent in a call (its result's metrics['seconds']).", ["op"],
                                 buckets=_BUCKETS, registry=self.registry)
        self.tokens = Counter("arctic_tokens",
                              "Tokens per operation: generated tokens for generate, batch tokens otherwise.", ["op"],
                              registry=self.registry)
        self.policy_version = Gauge("arctic_policy_version", "Weight version the samplers serve.",
                                    registry=self.registry)

    def record_ok(self, op: str, result: Result, policy_version: int) -> None:
        self.calls.labels(op, "ok").inc()
        self.seconds.labels(op).observe(result.metrics.get("seconds", 0.0))
        tokens = result.metrics.get("generated_tokens", result.metrics.get("tokens", 0.0))
        self.tokens.labels(op).inc(tokens)
        self.policy_version.set(policy_version)

    def record_error(self, op: str, error: str) -> None:
        self.calls.labels(op, error).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
