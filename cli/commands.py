"""Client-side command bodies behind `specdec generate`, `specdec gateway` and `specdec
health` (the CLI parses, this runs)."""

from __future__ import annotations

import argparse
import json
import sys

import grpc


def proposal_format(args: argparse.Namespace):
    """The --proposal flags as a ProposalFormat, or None for the client's default."""
    from specdec.proposals import ProposalFormat

    if args.proposal is None and args.proposal_dtype is None and args.top_n is None:
        return None
    if args.top_n is not None and args.proposal not in (None, "sparse"):
        raise ValueError(f"--top-n goes with --proposal sparse, not --proposal {args.proposal}")
    # A dtype alone is a dense q of that dtype, a --top-n alone a sparse one (greedy and typical
    # rounds send ids whatever is asked).
    kind = args.proposal or ("sparse" if args.top_n is not None else "dense")
    return ProposalFormat(kind=kind, dtype=args.proposal_dtype or "float32",
                          **({"top_n": args.top_n} if args.top_n is not None else {}))


def drafting_flags(args: argparse.Namespace) -> list[str]:
    """The drafting flags given (generate's and the gateway's): refused where nothing drafts."""
    return [flag for flag, given in (("--num-speculative-tokens", args.num_speculative_tokens != "auto"),
                                     ("--fanout", args.fanout), ("--proposal", args.proposal),
                                     ("--proposal-dtype", args.proposal_dtype), ("--top-n", args.top_n))
            if given]


def generate_command(args: argparse.Namespace, params) -> int:
    from client.speculative import SpeculativeClient
    from specdec_rpc.ops import read_token

    # γ at construction too: a fixed γ past the services' --max-draft-tokens is said once, at start
    try:
        client = SpeculativeClient(args.verifier, drafter=None if args.target_only else args.drafter,
                                   num_speculative_tokens=args.num_speculative_tokens,
                                   timeout_s=args.timeout_s, recovery_timeout_s=args.recovery_timeout_s,
                                   proposal_format=proposal_format(args), decode_steps=args.decode_steps,
                                   tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                   auth_token=read_token(args.auth_token_file) if args.auth_token_file else None)
    except grpc.RpcError as exc:
        print(f"specdec generate: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    try:
        return _run_generate(client, args, params)
    except BrokenPipeError:  # stdout's reader left (a ConnectionError too): main() ends quietly
        raise
    except (grpc.RpcError, ConnectionError, TimeoutError) as exc:
        # Said before the client closes: closing waits up to a few seconds more for the lost
        # sessions' last closes (a verifier that resumed drops its session now, not at its TTL).
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"specdec generate: error: {detail}", file=sys.stderr, flush=True)
        return 1
    finally:
        client.close()


def _run_generate(client, args: argparse.Namespace, params) -> int:
    from client.output import json_logprob

    if args.json:
        result = client.generate(args.prompt, params, num_speculative_tokens=args.num_speculative_tokens,
                                 target_only=args.target_only, chat=args.chat, fanout=args.fanout)
        out = result.to_dict()
        if out["logprobs"] is not None:
            out["logprobs"] = [{**e, "logprob": json_logprob(e["logprob"]),
                                "top_logprobs": {t: json_logprob(v) for t, v in e["top_logprobs"].items()}}
                               for e in out["logprobs"]]
        print(json.dumps(out, allow_nan=False))
        return 0
    result = None
    for chunk in client.stream(args.prompt, params, num_speculative_tokens=args.num_speculative_tokens,
                               target_only=args.target_only, chat=args.chat, fanout=args.fanout):
        print(chunk.text, end="", flush=True)
        result = chunk.result
    assert result is not None
    print()  # the text's line ends on stdout (a redirected file, the shell prompt after it)
    if result.logprobs is not None:
        _print_logprobs(result.logprobs, client.tokenizer)
    print(f"[{len(result.token_ids)} tokens in {result.elapsed_s:.2f} s = {result.tokens_per_s:.1f} tok/s; "
          f"rounds {result.num_rounds}; acceptance {result.acceptance_rate:.3f}; finish {result.finish_reason}]",
          file=sys.stderr)
    return 0


def _print_logprobs(entries: list[dict], tokenizer) -> None:
    """--logprobs without --json: a line per generated token, its logprob and rank under the
    target, then the top-N alternatives (the same entries --json prints, readable)."""
    def show(token_id: int) -> str:
        return repr(tokenizer.decode([token_id]))

    for entry in entries:
        top = "  ".join(f"{show(t)} {lp:.3f}" for t, lp in entry["top_logprobs"].items())
        print(f"{show(entry['token_id']):>16} {entry['logprob']:9.4f}  rank {entry['rank']:<5} {top}")


def health_command(args: argparse.Namespace) -> int:
    """Print the status; exit 0 only when SERVING (what a container healthcheck needs)."""
    from specdec.argtypes import check_port
    from specdec_rpc.ops import check_health, client_security

    if args.url:
        return _http_health(args.url, args.timeout_s, args.tls_ca)
    check_port(args.address, "--address")  # a bare host would dial 443
    try:
        status = check_health(args.address, args.service, timeout_s=args.timeout_s,
                              tls=client_security(args)[0])
    except grpc.RpcError as exc:
        details = exc.details()
        if exc.code() == grpc.StatusCode.NOT_FOUND and not details:  # the health service's answer to a name it lacks
            details = f"no service {args.service!r} here ('' is the whole server, or the service's full name)"
        print(f"specdec health: {args.address}: {exc.code().name}: {details}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _http_health(url: str, timeout_s: float, ca: str | None = None) -> int:
    """The gateway's /health: print its body; exit 0 only on 200 (its verifiers answer).
    ca: the CA bundle that signed an HTTPS gateway's certificate (--tls-ca, as for gRPC)."""
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as reply:
            body = reply.read().decode(errors="replace")
        try:  # a health reply: ours (JSON) or an empty 200 (vLLM's); a metrics port answers 200 on any path
            json.loads(body) if body.strip() else None
        except ValueError:
            print(f"specdec health: {url}: HTTP 200, but not a health reply (a metrics port? the gateway's is "
                  f"/health on its own port): {body[:200]!r}", file=sys.stderr)
            return 1
        print(body)
        return 0
    except urllib.error.HTTPError as exc:
        print(f"specdec health: {url}: HTTP {exc.code}: {exc.read().decode()[:500]}", file=sys.stderr)
    except http.client.BadStatusLine:  # an HTTP/2-only server answered HTTP/1.1 with its binary frames
        print(f"specdec health: {url}: not an HTTP/1.1 server (a gRPC port? ask it with "
              f"`specdec health --address HOST:PORT`)", file=sys.stderr)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        print(f"specdec health: {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def gateway_command(args: argparse.Namespace) -> int:
    import logging

    if not args.drafter and (drafting := drafting_flags(args)):  # before the imports below (torch): told at once
        raise ValueError(f"{', '.join(drafting)}: drafting flags need a --drafter (without one the gateway decodes "
                         "target-only)")
    from gateway import CORS, GatewayConfig, UpstreamConfig
    from gateway.server import serve
    from specdec_rpc.ops import read_token
    logging.basicConfig(level=args.log_level.upper(),
                        format="ts=%(asctime)s role=gateway level=%(levelname)s logger=%(name)s %(message)s")
    upstream = UpstreamConfig(
        verifier=args.verifier, drafter=args.drafter, num_speculative_tokens=args.num_speculative_tokens,
        fanout=args.fanout, proposal_format=proposal_format(args), decode_steps=args.decode_steps,
        timeout_s=args.timeout_s, recovery_timeout_s=args.recovery_timeout_s,
        tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        auth_token=read_token(args.auth_token_file) if args.auth_token_file else None,
        max_concurrent_requests=args.max_concurrent_requests)
    names = args.served_model_name or ()
    if isinstance(names, str):  # from $SPECDEC_GATEWAY_SERVED_MODEL_NAME: "a b" or "a,b"
        names = names.replace(",", " ").split() or [""]
    if any(not name.strip() for name in names):
        raise ValueError("--served-model-name: a model name may not be empty")
    limit = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    cors = CORS(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    config = GatewayConfig(upstream=upstream, api_key=args.api_key or None, served_model_names=tuple(names),
                           cors=cors, **limit)
    serve(config, args.host, args.port, grace_s=args.grace_s, ssl_certfile=args.ssl_certfile,
          ssl_keyfile=args.ssl_keyfile, log_level=args.log_level)
    return 0
