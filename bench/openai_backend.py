"""`specdec bench serve --backend openai`: the same workload, arrivals and metrics as the
gRPC backend (bench/serve.py), measured through any OpenAI-compatible server over
streaming HTTP: our gateway, vLLM, SGLang, llama.cpp's llama-server, TGI, Ollama.

Each request is one streamed POST to `--endpoint` (`/v1/chat/completions` with the
prompt's chat messages, or `/v1/completions` with its plain text) with
`stream_options.include_usage`, as vLLM's `benchmark_serving` sends it. Timings come from
SSE chunk arrival, as there: TTFT is the first chunk that carries text, ITL one gap per
later chunk that carries text, E2EL the last such chunk. Token counts come from the
server's `usage` (a server that sends none: one token per text chunk, logged). Against our
gateway a chunk is one speculative round, as a gRPC chunk is; against a server that
streams a token per chunk, ITL is per token. The gateway's extra `speculative` field
fills rounds, drafts, accepted drafts and the Draft / Verify times, so acceptance and the
cost model are reported for it too; for other servers they are null.

Prompts are sent as text: the server tokenizes and applies its own chat template, and
prompts too long for its context fail there (they are recorded with the server's error).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from dataclasses import dataclass

import httpx

from bench.datasets import BenchPrompt, interleave, load_dataset
from bench.serve import (
    WARMUP_MAX_TOKENS,
    BenchRequest,
    RequestRecord,
    WorkloadConfig,
    add_efficiency,
    assemble_result,
    dispatch,
    request_params,
    warn_if_cycled,
)
from specdec.sampling import SamplingParams

log = logging.getLogger(__name__)

CHAT_ENDPOINT, COMPLETIONS_ENDPOINT = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)


@dataclass(frozen=True)
class OpenAITarget:
    base_url: str  # the server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    endpoint: str | None = None  # default: chat completions when the workload is chat, else completions
    model: str | None = None  # default: the first of GET /v1/models
    api_key: str | None = None
    tls_ca: str | None = None  # the CA bundle that signed an HTTPS server's certificate (default: system roots)

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


class OpenAIServer:
    """One HTTP connection pool to the server, shared by the worker threads."""

    def __init__(self, target: OpenAITarget, config: WorkloadConfig) -> None:
        self.target = target
        self.endpoint = target.endpoint or (CHAT_ENDPOINT if config.chat else COMPLETIONS_ENDPOINT)
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        self.chat = self.endpoint == CHAT_ENDPOINT
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        connections = max(1, config.max_concurrency or config.num_prompts)
        # The read timeout bounds the wait for the next chunk, like the gRPC backend's per-call deadline.
        verify = ssl.create_default_context(cafile=target.tls_ca) if target.tls_ca else True
        self.http = httpx.Client(base_url=target.root, headers=headers, verify=verify,
                                 timeout=httpx.Timeout(config.timeout_s, connect=10.0),
                                 limits=httpx.Limits(max_connections=connections,
                                                     max_keepalive_connections=connections))
        self.model = target.model or self._first_model()
        self._warned_usage = False

    def _first_model(self) -> str:
        reply = self.http.get("/v1/models")
        reply.raise_for_status()
        models = reply.json().get("data") or []
        if not models:
            raise ValueError(f"{self.target.root}/v1/models lists no model; pass --model")
        return models[0]["id"]

    def close(self) -> None:
        self.http.close()

    def payload(self, prompt: BenchPrompt, params: SamplingParams) -> dict:
        body: dict = {"model": self.model, "max_tokens": params.max_tokens, "temperature": params.temperature,
                      "top_p": params.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if params.seed is not None:
            body["seed"] = params.seed
        # vLLM's extra fields, only when they change something: a strict server may refuse them.
        if params.top_k:
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if params.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = prompt.chat_messages()
        else:
            body["prompt"] = prompt.text
        return body

    def send(self, req: BenchRequest, config: WorkloadConfig, gamma, run_start: float,
             deadline: float | None) -> RequestRecord:
        """One streamed request, measured (the `send` of bench.serve.dispatch)."""
        rec = RequestRecord(index=req.index, category=req.prompt.category, prompt_id=req.prompt.id, input_tokens=0)
        if deadline is not None and time.perf_counter() >= deadline:
            rec.error = "not sent: duration limit reached"
            return rec
        body = self.payload(req.prompt, request_params(config, req))
        sent = last = time.perf_counter()
        rec.start = sent - run_start
        chunks, usage, spec, finish = 0, None, None, None
        try:
            with self.http.stream("POST", self.endpoint, json=body) as reply:
                if reply.status_code != 200:
                    reply.read()
                    rec.error = f"HTTP {reply.status_code}: {_error_message(reply)}"
                    return rec
                for line in reply.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments (keep-alives)
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        rec.error = f"stream error: {event['error'].get('message', event['error'])}"
                        break
                    now = time.perf_counter()
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                        if text:
                            if rec.ttft is None:
                                rec.ttft = now - sent
                            else:
                                rec.itl.append(now - last)
                            last = now
                            chunks += 1
                        finish = choice.get("finish_reason") or finish
                        if finish and rec.ttft is None:  # the first token was EOS (no text): it came now
                            rec.ttft, last = now - sent, now
                    usage = event.get("usage") or usage
                    spec = event.get("speculative") or spec
                    if deadline is not None and now >= deadline and finish is None:
                        rec.error = "aborted: duration limit reached"
                        break
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        if rec.error is None and finish is None:
            rec.error = "stream ended without a finish_reason"
        if rec.error is not None:
            return rec
        rec.e2el = last - sent
        rec.finish_reason = finish
        if usage:
            rec.input_tokens = int(usage.get("prompt_tokens") or 0)
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
        else:
            if not self._warned_usage:
                log.warning("%s sends no usage: output tokens counted as text chunks", self.target.root)
                self._warned_usage = True
            rec.output_tokens = chunks
        if spec:  # our gateway's counters
            rec.rounds = int(spec.get("num_rounds", 0))
            # None: a server that does not say (the share is then unknown, not 0)
            rec.speculative_rounds = (int(spec["num_speculative_rounds"]) if "num_speculative_rounds" in spec
                                      else None)
            rec.draft_tokens = int(spec.get("num_draft_tokens", 0))
            rec.accepted_tokens = int(spec.get("num_accepted_tokens", 0))
            rec.draft_time = float(spec.get("draft_time_s", 0.0))
            rec.verify_time = float(spec.get("verify_time_s", 0.0))
        return rec


def _error_message(reply: httpx.Response) -> str:
    try:
        err = reply.json().get("error")
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return reply.text[:200]


def _send(server: OpenAIServer, req: BenchRequest, config: WorkloadConfig, gamma, run_start: float,
          deadline: float | None) -> RequestRecord:
    return server.send(req, config, gamma, run_start, deadline)


def build_requests(config: WorkloadConfig) -> list[BenchRequest]:
    """bench.serve's order (seeded, category-interleaved, cycling); no local tokenizer, so
    prompt_ids stay empty and input tokens come from the server's usage."""
    prompts = interleave(load_dataset(config.dataset), config.seed)
    warn_if_cycled(len(prompts), config)
    return [BenchRequest(i, prompts[i % len(prompts)], ()) for i in range(config.num_prompts)]


def run_serve_openai(config: WorkloadConfig, target: OpenAITarget) -> dict:
    """One run of the workload against an OpenAI-compatible server; bench.serve's result keys
    (the speedup model's fields are null: γ is the server's business)."""
    server = OpenAIServer(target, config)
    # What the endpoint does, not what --chat asked: /v1/completions applies no template (its
    # results said "chat" beside a gRPC run's and compared as the same workload).
    config = config.replace(chat=server.chat)
    try:
        requests = build_requests(config)
        for req in requests[: config.warmup_requests]:
            warm = config.replace(params=config.params.replace(max_tokens=WARMUP_MAX_TOKENS))
            rec = server.send(req, warm, None, time.perf_counter(), None)
            if rec.error:
                log.warning("warm-up request failed: %s", rec.error)
        records, duration = dispatch(server, requests, config, None, send=_send)
    finally:
        server.close()
    result = assemble_result(config, records, duration, backend="openai", gamma=None, server_stats={},
                             verifier_model=server.model, drafter_model=None, mode="openai",
                             base_url=target.root, endpoint=server.endpoint)
    return add_efficiency(result, None)
