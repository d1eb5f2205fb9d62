"""Prometheus metrics of the gateway (`GET /metrics`), on a registry of its own.

The serving metrics have vLLM's names and its `model_name` label, so a vLLM dashboard reads
them unchanged: `vllm:e2e_request_latency_seconds`, `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:time_per_output_token_seconds` (per request),
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:num_requests_running` /
`_waiting` (holding a generation slot / waiting for one),
`vllm:request_success_total{finished_reason}`, per completed request its
`vllm:request_prompt_tokens` / `_generation_tokens` and its phases
`vllm:request_queue_time_seconds` (waiting for a generation slot), `_prefill_time_seconds`
(the slot to the first token), `_decode_time_seconds` (first to last token),
`_inference_time_seconds` (the slot to the last token), and the speculative counters
`vllm:spec_decode_num_drafts_total` / `_num_draft_tokens_total` / `_num_accepted_tokens_total`
(acceptance: `rate(vllm:spec_decode_num_accepted_tokens_total[5m]) /
rate(vllm:spec_decode_num_draft_tokens_total[5m])`). Ours keep an `endpoint` label beside it;
`specdec_gateway_requests_total{endpoint,status}` counts HTTP answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from client.speculative import GenerationResult
from specdec_rpc.ops import GCCollector

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)  # vLLM's 1-2-5


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(GCCollector())  # the process's collection pauses (the CLI's gateway freezes its start-up heap)
        per_model = ["model_name", "endpoint"]
        self.requests = Counter("specdec_gateway_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "generations in flight (holding a slot)",
                             ["model_name"], registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "generations waiting for a slot (--max-concurrent-requests)",
                             ["model_name"], registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "request arrival to its last token (completed generations)", per_model,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "request arrival to the first generated token",
                              per_model, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "time per token after the first: a round's gap over the tokens it committed "
                             "(observed once per token)", per_model, buckets=_TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "per completed request: (last token - first token) / (its tokens - 1)", per_model,
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of generations", per_model, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated", per_model, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "rounds that verified drafts", per_model, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens proposed by the drafter",
                                    per_model, registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "draft tokens accepted by the "
                                       "verifier", per_model, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "prompt tokens per completed request",
                                               per_model, buckets=_LENGTH_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "tokens generated per completed request", per_model,
                                                   buckets=_LENGTH_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "arrival to a generation slot",
                                    per_model, buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "a generation slot to the first token",
                                      per_model, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "the first token to the last",
                                     per_model, buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "a generation slot to the last token",
                                        per_model, buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("vllm:request_success", "generations by finish reason (stop, length, abort: the "
                                "client went away, error)", ["model_name", "endpoint", "finished_reason"], registry=r)

    def timer(self, model: str, endpoint: str) -> "RequestTimer":
        return RequestTimer(self, model, endpoint)


@dataclass
class RequestTimer:
    """One generation's timings, recorded as its chunks arrive."""

    metrics: GatewayMetrics
    model: str
    endpoint: str
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def chunk(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.first = now
            self.metrics.ttft.labels(self.model, self.endpoint).observe(now - self.start)
        elif num_tokens:
            per_token = (now - self.last) / num_tokens
            hist = self.metrics.itl.labels(self.model, self.endpoint)
            for _ in range(num_tokens):
                hist.observe(per_token)
        self.last = now
        self.tokens += num_tokens

    def finish(self, prompt_tokens: int, result: GenerationResult | None, reason: str | None = None,
               scored_only: bool = False, scheduled: float | None = None) -> None:
        """result: the finished generation; None when it ended early (reason: abort / error).
        scored_only: a request that scores its prompt (echo, max_tokens 0): the token generated
        for its logits is not part of the answer, so none counts as generated. scheduled: when
        it got its generation slot (perf_counter)."""
        m, labels = self.metrics, (self.model, self.endpoint)
        m.prompt_tokens.labels(*labels).inc(prompt_tokens)
        generated = 0 if scored_only else len(result.token_ids) if result is not None else self.tokens
        m.generation_tokens.labels(*labels).inc(generated)
        if result is not None:
            now = time.perf_counter()
            m.e2e.labels(*labels).observe(now - self.start)
            if self.first is not None and generated > 1:
                m.tpot.labels(*labels).observe((now - self.first) / (len(result.token_ids) - 1))
            m.request_prompt_tokens.labels(*labels).observe(len(result.prompt_token_ids))  # each choice's own
            m.request_generation_tokens.labels(*labels).observe(generated)
            if scheduled is not None and self.first is not None:
                m.queue_time.labels(*labels).observe(scheduled - self.start)
                m.prefill_time.labels(*labels).observe(self.first - scheduled)
                m.decode_time.labels(*labels).observe(now - self.first)
                m.inference_time.labels(*labels).observe(now - scheduled)
            m.drafts.labels(*labels).inc(result.num_speculative_rounds)
            m.draft_tokens.labels(*labels).inc(result.num_draft_tokens)
            m.accepted_tokens.labels(*labels).inc(result.num_accepted_tokens)
        m.finished.labels(*labels, result.finish_reason if result is not None else (reason or "error")).inc()
