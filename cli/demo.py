"""`specdec demo`: both services as local processes, speculative vs target-only in one run,
then the OpenAI-compatible gateway in front of them and a curl line that works against it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time

from client.launcher import ServiceProcess, ServiceStartError, start_gateway, start_services
from client.speculative import SpeculativeClient
from specdec.errors import SpecDecError
from specdec.sampling import SamplingParams

DEFAULT_PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "List three tips for staying focused while studying.",
)


def run_demo(args: argparse.Namespace) -> int:
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    drafter_args = shlex.split(args.drafter_args)
    gamma = args.num_speculative_tokens
    # checked before the services start (tens of seconds), not after
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    print("starting drafter and verifier (the first run converts the embedded model once)...", flush=True)
    services = []
    try:
        try:  # both at once: their imports and model loads overlap
            services.extend(start_services([("drafter", drafter_args), ("verifier", shlex.split(args.verifier_args))]))
        except ServiceStartError as exc:
            raise _start_error(exc) from None
        drafter, verifier = (s.address for s in services)
        print(f"drafter at {drafter}, verifier at {verifier}", flush=True)
        with SpeculativeClient(verifier, drafter=drafter, num_speculative_tokens=gamma) as client:
            print(f"drafter: {client.drafter_info.model}  verifier: {client.verifier_info.model}  gamma={gamma}\n")
            client.generate(prompts[0], params.replace(max_tokens=4), chat=True)  # warm-up both sides
            totals = {"spec": [0, 0.0], "target": [0, 0.0]}
            proposed = accepted = 0
            for prompt in prompts:
                base = client.generate(prompt, params, chat=True, target_only=True)
                spec = client.generate(prompt, params, chat=True)
                totals["target"][0] += len(base.token_ids)
                totals["target"][1] += base.elapsed_s
                totals["spec"][0] += len(spec.token_ids)
                totals["spec"][1] += spec.elapsed_s
                proposed += spec.num_draft_tokens
                accepted += spec.num_accepted_tokens
                same = "identical to target-only" if spec.token_ids == base.token_ids else "differs from target-only"
                print(f"> {prompt}\n{spec.text.strip()}\n"
                      f"  [{len(spec.token_ids)} tokens, acceptance {spec.acceptance_rate:.3f}, "
                      f"{spec.tokens_per_s:.1f} tok/s speculative vs {base.tokens_per_s:.1f} tok/s target-only, "
                      f"{same}]\n", flush=True)
            spec_tps = totals["spec"][0] / totals["spec"][1]
            base_tps = totals["target"][0] / totals["target"][1]
            print(f"overall: acceptance {accepted / max(proposed, 1):.3f}; speculative {spec_tps:.1f} tok/s, "
                  f"target-only {base_tps:.1f} tok/s, speedup {spec_tps / base_tps:.2f}x")
        gateway_args = shlex.split(args.gateway_args)
        try:
            services.append(start_gateway(verifier, drafter, ["--num-speculative-tokens", str(gamma), *gateway_args]))
        except ServiceStartError as exc:
            raise _start_error(exc) from None
        _show_gateway(services[-1], args.keep_running, _api_key(gateway_args))
    finally:
        for s in reversed(services):
            s.stop()
    return 0


def _start_error(exc: ServiceStartError) -> SpecDecError:
    """The service's own error line, not a traceback."""
    errors = [line for line in exc.output if "error:" in line]
    last = errors[-1] if errors else (exc.output[-1] if exc.output else "no output")
    return SpecDecError(f"the {exc.role} did not start: {last}")


def _api_key(gateway_args: list[str]) -> str | None:
    """The gateway's --api-key among --gateway-args (else $SPECDEC_GATEWAY_API_KEY), to call it with."""
    for i, arg in enumerate(gateway_args):
        if arg == "--api-key" and i + 1 < len(gateway_args):
            return gateway_args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return os.environ.get("SPECDEC_GATEWAY_API_KEY") or None


def _show_gateway(gateway: ServiceProcess, keep_running: bool, api_key: str | None = None) -> None:
    """Print a curl command for the gateway, and what the gateway answers to it."""
    import httpx

    url = f"http://{gateway.address}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Why is the sky blue? One sentence."}], "max_tokens": 48,
            "temperature": 0}
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    print(f"\nOpenAI-compatible gateway at http://{gateway.address}/v1 (specdec gateway); "
          f"{'try' if keep_running else 'with --keep-running it stays up to try'}:\n"
          f"  curl -s {url} -H 'Content-Type: application/json'{auth} -d {shlex.quote(json.dumps(body))}\n"
          f"  (add \"stream\": true for server-sent events)", flush=True)
    reply = httpx.post(url, json=body, timeout=300, headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    if reply.status_code != 200:
        raise SpecDecError(f"the gateway answered {reply.status_code}: {reply.text[:300]}")
    reply = reply.json()
    print(f"it answers: {reply['choices'][0]['message']['content'].strip()!r}\n"
          f"  usage {reply['usage']}, speculative {json.dumps(reply['speculative'])}", flush=True)
    if keep_running:
        print("services and gateway keep running; Ctrl-C stops them", flush=True)
        while True:
            time.sleep(3600)
    print("the demo stops the services and the gateway now (--keep-running keeps them up)", flush=True)
