"""Prometheus metrics of the gateway (`GET /metrics`), on a registry of its own.

Names follow vLLM's front end where one exists (e2e latency, TTFT, inter-token latency,
prompt / generation tokens) under the `specdec_gateway_` prefix; the speculative counters
(drafts proposed / accepted) make the acceptance rate a PromQL ratio:
`rate(specdec_gateway_accepted_tokens_total[5m]) / rate(specdec_gateway_draft_tokens_total[5m])`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from client.speculative import GenerationResult

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdec_gateway_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("specdec_gateway_requests_running", "generations in flight or waiting for a slot",
                             registry=r)
        self.e2e = Histogram("specdec_gateway_e2e_request_latency_seconds",
                             "request arrival to its last token (completed generations)", ["endpoint"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specdec_gateway_time_to_first_token_seconds",
                              "request arrival to the first generated token", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_gateway_inter_token_latency_seconds",
                             "time per token after the first: a round's gap over the tokens it committed "
                             "(observed once per token)", ["endpoint"], buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_gateway_prompt_tokens", "prompt tokens of generations", registry=r)
        self.generation_tokens = Counter("specdec_gateway_generation_tokens", "tokens generated", registry=r)
        self.draft_tokens = Counter("specdec_gateway_draft_tokens", "draft tokens proposed by the drafter",
                                    registry=r)
        self.accepted_tokens = Counter("specdec_gateway_accepted_tokens", "draft tokens accepted by the verifier",
                                       registry=r)
        self.finished = Counter("specdec_gateway_finished_requests", "generations by finish reason "
                                "(stop, length, abort: the client went away, error)", ["finish_reason"], registry=r)

    def timer(self, endpoint: str) -> "RequestTimer":
        return RequestTimer(self, endpoint)


@dataclass
class RequestTimer:
    """One generation's timings, recorded as its chunks arrive."""

    metrics: GatewayMetrics
    endpoint: str
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None
    tokens: int = 0

    def chunk(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.labels(self.endpoint).observe(now - self.start)
        elif num_tokens:
            per_token = (now - self.last) / num_tokens
            hist = self.metrics.itl.labels(self.endpoint)
            for _ in range(num_tokens):
                hist.observe(per_token)
        self.last = now
        self.tokens += num_tokens

    def finish(self, prompt_tokens: int, result: GenerationResult | None, reason: str | None = None) -> None:
        """result: the finished generation; None when it ended early (reason: abort / error)."""
        m = self.metrics
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(len(result.token_ids) if result is not None else self.tokens)
        if result is not None:
            m.e2e.labels(self.endpoint).observe(time.perf_counter() - self.start)
            m.draft_tokens.inc(result.num_draft_tokens)
            m.accepted_tokens.inc(result.num_accepted_tokens)
        m.finished.labels(result.finish_reason if result is not None else (reason or "error")).inc()
