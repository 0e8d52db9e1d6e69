"""Prometheus metrics of the HTTP server: calls, seconds and tokens per operation, process memory,
and the load of the moment (calls and samples running and waiting, KV cache use).

Each app owns its registry (not prometheus_client's global one), so several servers in one
process (tests, a sidecar) never mix their counts. The per-call numbers come from
``Result.metrics``, the same numbers every response carries. The sampler's load is also given
under vLLM's gauge names (``vllm:num_requests_running`` ...), which PRIME-RL's orchestrator and
dashboards built for vLLM read; like vLLM, they count samples (a request of ``n`` samples is ``n``).
A sampler that counts its decode steps (the embedded engine) gives them too: beside the generate
calls counted here, they show whether the calls of many callers share the sampler's steps.
"""

from __future__ import annotations

from typing import Any

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
        self.load = {name: Gauge(name, about, registry=self.registry) for name, about in _LOAD_GAUGES.items()}

    def record_ok(self, op: str, result: Result, policy_version: int) -> None:
        self.calls.labels(op, "ok").inc()
        self.seconds.labels(op).observe(result.metrics.get("seconds", 0.0))
        tokens = result.metrics.get("generated_tokens", result.metrics.get("tokens", 0.0))
        self.tokens.labels(op).inc(tokens)
        self.policy_version.set(policy_version)

    def record_error(self, op: str, error: str) -> None:
        self.calls.labels(op, error).inc()

    def render(self, load: dict[str, Any]) -> bytes:
        """The metrics, with the gauges of ``load`` (``ArcticServer.load()``) set to its values."""
        sampler = load["sampler"]
        values = {"arctic_generate_calls": load["generate_calls"], "arctic_training_calls": load["calls"]["training"]}
        if sampler:
            used = sampler["kv_used_blocks"] / max(sampler["kv_blocks"], 1)
            for prefix in ("arctic_sampler_", "vllm:"):
                values |= {f"{prefix}num_requests_running": sampler["running"],
                           f"{prefix}num_requests_waiting": sampler["waiting"],
                           f"{prefix}num_preemptions_total": sampler["preempted"],
                           f"{prefix}kv_cache_usage_perc": used}
            if "decode_steps" in sampler:  # the embedded engine counts them; vLLM's sampler does not
                values["arctic_sampler_decode_steps_total"] = sampler["decode_steps"]
        for name, value in values.items():
            self.load[name].set(value)
        return generate_latest(self.registry)


_LOAD_GAUGES = {
    "arctic_generate_calls": "Generate calls in flight (running or waiting for the sampler).",
    "arctic_training_calls": "Training calls running (fwd_bwd, step, log_probs, sync_weights: one at a time).",
    **{f"{prefix}{name}": about for prefix in ("arctic_sampler_", "vllm:") for name, about in (
        ("num_requests_running", "Samples the sampler decodes now."),
        ("num_requests_waiting", "Samples waiting to start (in line or being prefilled)."),
        ("num_preemptions_total", "Samples preempted so far (their blocks taken back, to be recomputed)."),
        ("kv_cache_usage_perc", "Share of the KV cache's blocks in use (0 to 1)."))},
    "arctic_sampler_decode_steps_total": "Decode steps the sampler ran so far (generate calls in flight together "
                                         "share them).",
}
