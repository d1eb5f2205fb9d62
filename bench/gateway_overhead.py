"""What the HTTP gateway itself costs, without a model: `python -m bench.gateway_overhead`.

Model time on a CPU varies by tens of percent from run to run, far more than the gateway
adds, so an A/B of `bench serve` through gRPC and through the gateway cannot resolve it.
Here the gateway (the real app, uvicorn, its worker pool and the real tokenizer with its
chat template) runs in a child process over a stub client whose rounds cost nothing: each
yields `--tokens-per-round` tokens at once. A request's latency is then the gateway's own
work: validation, tokenization, the hand-offs to tasks, JSON / SSE encoding and HTTP. The
per-request cost is the latency of a one-token completion; the per-token cost is the
slope over `--max-tokens`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from client.speculative import GenerationResult, StreamChunk
from specdec.sampling import SamplingParams


class _StubClient:
    """Duck-types the SpeculativeClient surface the gateway uses; rounds are free."""

    def __init__(self, tokens_per_round: int) -> None:
        from specdec.models import ModelSpec, load_tokenizer
        from specdec.serving import ModelInfo

        self.tokenizer = load_tokenizer(ModelSpec(model="embedded"))
        self.verifier_info = ModelInfo(role="verifier", model="stub", vocab_size=49152, eos_token_ids=(2,),
                                       max_context=4096, tokenizer_fingerprint="", tokenizer_source="embedded",
                                       dtype="float32", device="cpu", max_draft_tokens=16)
        self.drafters = self.verifiers = None
        self.tokens_per_round = tokens_per_round
        self._token = self.tokenizer(" the", add_special_tokens=False).input_ids[0]

    def encode_prompt(self, prompt, chat: bool = False, *, tokenizer=None) -> list[int]:
        tokenizer = tokenizer or self.tokenizer
        return list(tokenizer(prompt, add_special_tokens=False).input_ids) if isinstance(prompt, str) else prompt

    def encode_chat(self, messages, add_generation_prompt: bool = True, tokenizer=None,
                    **template_options) -> list[int]:
        ids = (tokenizer or self.tokenizer).apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **template_options)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def astream(self, prompt_ids, params: SamplingParams, **_):
        result = GenerationResult(text="", token_ids=[], prompt_token_ids=list(prompt_ids), finish_reason="length")
        while len(result.token_ids) < params.max_tokens:
            new = [self._token] * min(self.tokens_per_round, params.max_tokens - len(result.token_ids))
            result.token_ids += new
            result.num_rounds += 1
            text = " the" * len(new)
            result.text += text
            done = len(result.token_ids) >= params.max_tokens
            yield StreamChunk(token_ids=new, text=text, result=result if done else None)

    def close(self) -> None:
        pass


def _serve(port: int, tokens_per_round: int) -> None:
    import logging

    from gateway.app import GatewayConfig
    from gateway.server import serve
    from gateway.upstream import Upstream, UpstreamConfig

    logging.basicConfig(level=logging.WARNING)
    config = GatewayConfig(upstream=UpstreamConfig(verifier="stub:1"))
    upstream = Upstream(config.upstream, client_factory=lambda _: _StubClient(tokens_per_round))
    serve(config, "127.0.0.1", port, log_level="warning", upstream=upstream)


def measure(url: str, max_tokens: int, stream: bool, n: int) -> float:
    """Median seconds of n sequential chat completions."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Why is the sky blue? Answer in one sentence."}],
            "max_tokens": max_tokens, "stream": stream}
    times = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            if stream:
                with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                    for _line in reply.iter_lines():
                        pass
            else:
                http.post("/v1/chat/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8099)
    p.add_argument("--requests", type=int, default=200, help="sequential requests per point")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tokens-per-round", type=int, default=5, help="tokens per streamed chunk (γ + 1 at α = 1)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        _serve(args.port, args.tokens_per_round)
        return 0
    child = subprocess.Popen([sys.executable, "-m", "bench.gateway_overhead", "--serve", "--port", str(args.port),
                              "--tokens-per-round", str(args.tokens_per_round)])
    url = f"http://127.0.0.1:{args.port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:  # connected to the stub
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the stub gateway did not start")
            time.sleep(0.2)
        measure(url, 1, False, 20)  # warm-up
        out = {}
        for stream in (False, True):
            one = measure(url, 1, stream, args.requests)
            many = measure(url, args.max_tokens, stream, args.requests)
            rounds = -(-args.max_tokens // args.tokens_per_round)
            out["stream" if stream else "non_stream"] = {
                "per_request_ms": 1000 * one, f"latency_{args.max_tokens}_tokens_ms": 1000 * many,
                "per_token_ms": 1000 * (many - one) / (args.max_tokens - 1),
                "per_chunk_ms": 1000 * (many - one) / max(rounds - 1, 1)}
        print(json.dumps({"requests_per_point": args.requests, "tokens_per_round": args.tokens_per_round, **out},
                         indent=2))
    finally:
        child.terminate()
        child.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
