"""`specdec drafter|verifier|gateway|generate|health|demo|bench`: parse arguments, then call a module.

Service and client modules are imported inside the command functions, so that the
core package itself never imports grpc.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading

from specdec.argtypes import (  # noqa: F401
    device as device_arg,
    LOGPROBS_MODES, MAX_TIMEOUT_S, MAX_WAIT_MS, AddressList, add_client_security_args, add_decode_steps_arg, gamma_arg,
    log_level, port, positive, string_list,
)
from specdec.errors import SpecDecError

DEFAULT_PORTS = {"drafter": 50051, "verifier": 50052, "gateway": 8000}
MAX_THREADS_PER_CPU = 4  # --threads above this many per CPU is a typo, not oversubscription


def _cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, a container's cpuset), not the
    host's count, which oversubscribed a pinned service."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, naming the argument, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_model_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--model", default="embedded",
                   help="HF model id (from the local HF cache), local directory, or 'embedded' (SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model's directory")
    p.add_argument("--dtype", default=None if role == "drafter" else "float32",
                   choices=["float32", "float16", "bfloat16"],
                   help="drafter default: float16, or bfloat16 under --quantize auto's int4; a dtype given here "
                        "turns auto's int4 off" if role == "drafter" else None)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "mkl", "onednn"],
                   help="float32 CPU linears: prepacked oneDNN (auto picks it for float32 on a CPU; multi-token "
                        "verifies and batched steps ~1.7x faster) or MKL")
    p.add_argument("--prefill-dtype", default="auto", choices=["auto", "none", "float32", "float16", "bfloat16"],
                   help="a second weights copy for rows of >= 3 tokens (prompts, catch-ups); auto: on a CPU, the "
                        "dtype whose multi-row matmuls run natively by its flags (e.g. float32 for a float16 drafter "
                        "on AVX2, bfloat16 with AVX512-BF16), none on CUDA. The drafter's only: a verifier scores "
                        "every row with its own weights")
    p.add_argument("--quantize", default="auto" if role == "drafter" else "none", choices=["none", "int8", "int4", "auto"],
                   help="CPU only. int4: weight-only int4 decoder linears (groups of 32, bfloat16 activations; "
                        "overrides --dtype), a drafter step ~2x cheaper; int8: dynamic int8 decoder layers (a "
                        "low-acceptance drafter; not a verifier's: its activation scale spans a row); auto (the "
                        "drafter's default): int4 on a CPU with native bfloat16 (AVX512-BF16 / AMX) unless --dtype "
                        "is given, else none")
    p.add_argument("--fast-path", default="auto", choices=["auto", "on", "off"],
                   help="static KV slot pool + bucketed static-shape forward, replayed as CUDA graphs on CUDA "
                        "(auto: on for CUDA, off for CPU, where it runs eagerly)")
    if role == "drafter":
        p.add_argument("--backend", default="model", choices=["model", "ngram"],
                       help="model: draft with --model's weights; ngram: prompt lookup, no weights (--model gives only "
                            "the tokenizer, vocabulary, EOS ids and context)")
        p.add_argument("--ngram-min", type=positive("--ngram-min", zero=True), default=None,
                       help="--backend ngram: shortest suffix n-gram looked up (default 1)")
        p.add_argument("--ngram-max", type=positive("--ngram-max", zero=True), default=None,
                       help="--backend ngram: longest suffix n-gram looked up, the longest match wins (default 4)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port("--port"), default=DEFAULT_PORTS[role], help="0 picks a free port")
    # Bounded: torch starts one OpenMP thread per unit, and 100000 exhausted the host's threads.
    p.add_argument("--threads", type=positive("--threads", zero=True, maximum=MAX_THREADS_PER_CPU * _cpus()), default=0,
                   help="torch intra-op threads (0 = all cores; the services alternate, so each may use all)")
    p.add_argument("--max-draft-tokens", type=positive("--max-draft-tokens", zero=True), default=16,
                   help="largest gamma a request may ask for (bounds memory per request)")
    p.add_argument("--max-sessions", type=positive("--max-sessions"), default=256,
                   help="live sessions; beyond it the least recently used idle session is evicted")
    p.add_argument("--kv-budget-mb", type=positive("--kv-budget-mb", float), default=None,
                   help="KV memory of all sessions (each holds a static --max-model-len slot); LRU eviction beyond")
    p.add_argument("--max-model-len", type=positive("--max-model-len", zero=True), default=None,
                   help="KV positions per session (default: min(model's maximum, 2048))")
    p.add_argument("--max-batch-size", type=positive("--max-batch-size"), default=32,
                   help="requests of different sessions run in one forward")
    p.add_argument("--max-num-batched-tokens", type=positive("--max-num-batched-tokens"), default=None,
                   help="tokens one engine step runs (vLLM's name): longer prompts are prefilled in chunks between "
                        "the other sessions' steps (default: 256 on CPU, 2048 on CUDA)")
    p.add_argument("--max-wait-ms", type=positive("--max-wait-ms", float, zero=True, maximum=MAX_WAIT_MS), default=10.0,
                   help="how long a non-full batch waits for more requests, only while batches hold > 1 request")
    p.add_argument("--session-ttl-s", type=positive("--session-ttl-s", float), default=600.0,
                   help="idle sessions are closed after this")
    p.add_argument("--evict-after-idle-s", type=positive("--evict-after-idle-s", float, zero=True), default=2.0,
                   help="when full, a new session evicts the least recently used one idle at least this long "
                        "(a generation between rounds is idle for milliseconds); when no session is, new ones "
                        "get RESOURCE_EXHAUSTED and clients queue. 0: evict any session without a call in flight")
    if role == "verifier":
        p.add_argument("--speculative-disable-by-batch-size", type=positive("--speculative-disable-by-batch-size",
                                                                            zero=True), default=None,
                       help="at this many running sessions tell clients to stop drafting until the load drops "
                            "(vLLM's name; 0 = never: the clients' adaptive gamma decides alone). Default: 2 on a "
                            "CPU, where a drafter and a verifier sharing the cores oversubscribe them as soon as "
                            "sessions draft and verify at once; 0 on CUDA")
        p.add_argument("--max-streams", type=positive("--max-streams", zero=True), default=64,
                       help="VerifyStreams served at once (one per client process: gateway, bench); each holds a "
                            "server thread for its life. Past it clients send VerifyBatch calls")
        p.add_argument("--sampler-backend", default="auto", choices=["auto", "torch", "triton"],
                       help="batched speculative sampler: the fused Triton kernel (CUDA; auto picks it when triton "
                            "imports) or torch ops; both emit the same tokens for the same seed")
        p.add_argument("--logprobs-mode", default=LOGPROBS_MODES[0], choices=LOGPROBS_MODES,
                       help="what requested logprobs of generated tokens are (vLLM's flag): under the distribution "
                            "each token was sampled from, after temperature, top-k/p, penalties and bias "
                            "(default), or under the model's raw one (vLLM V1's default)")
    if role == "drafter":
        p.add_argument("--speculation-slots", type=positive("--speculation-slots", zero=True), default=16,
                       help="KV slots for branches pre-drafted while the verifier works (requests with fanout > 0), "
                            "shared by all sessions; 0 turns the speculation cache off")
    p.add_argument("--grace-s", type=positive("--grace-s", float, zero=True), default=5.0,
                   help="on SIGTERM, wait this long for in-flight calls")
    p.add_argument("--log-level", type=log_level, default="INFO")


def _add_ops_args(p: argparse.ArgumentParser) -> None:
    """Security and operations flags of a service (see README, Deployment and operations)."""
    p.add_argument("--metrics-port", type=port("--metrics-port"), default=0,
                   help="serve Prometheus /metrics on this port (0 = off)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--auth-token-file", default=None,
                   help="accepted bearer tokens, one per line; calls without one get UNAUTHENTICATED")


def _apply_env_defaults(p: argparse.ArgumentParser, role: str, shared: bool = True) -> None:
    """Every `--some-flag` of a service defaults to $SPECDEC_<ROLE>_SOME_FLAG, else (when
    `shared`) $SPECDEC_SOME_FLAG (how containers are configured); a flag on the command line wins.
    An empty variable is an unset one (compose's `${VAR:-}`): the flag keeps its default."""
    checks = []
    for action in p._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or action.dest == "help":
            continue
        name = flags[0][2:].upper().replace("-", "_")
        for var in (f"SPECDEC_{role.upper()}_{name}", f"SPECDEC_{name}")[: 2 if shared else 1]:
            value = os.environ.get(var)
            if not value:  # None skipped argparse's `type` and its checks: --grace-s became None, no drain
                continue
            if action.nargs == 0:  # store_true / store_false
                action.default = value.strip().lower() in ("1", "true", "yes", "on")
            else:
                action.default = value  # argparse runs `type` on string defaults
                if action.type is not None:
                    action.type = _naming_env(action.type, var, action.default)
                checks.append((var, action.dest, action.choices))
            break
    p.set_defaults(_env_checks=checks)


def _naming_env(convert, var: str, value: str | None):
    """`convert`, whose error names the variable when it converts that variable's value."""
    def from_env(text: str):
        try:
            return convert(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            if text is not value:
                raise
            raise argparse.ArgumentTypeError(f"${var}={text!r}: {exc}") from None
    from_env.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its messages
    return from_env


def _check_env_values(args: argparse.Namespace) -> None:
    """argparse never checks `choices` for defaults; do it for values taken from the environment."""
    for var, dest, choices in getattr(args, "_env_checks", ()):
        value = getattr(args, dest)
        if choices is not None and value is not None and value not in choices:
            raise ValueError(f"${var}={value!r} is not one of {', '.join(map(str, choices))}")


def _check_serving_files(args: argparse.Namespace) -> None:
    """TLS and token files (services, the gateway, generate), before the model loads or the
    connection loop starts, each by its flag: gRPC itself only says that the port could not be
    bound, and a gateway retried a missing CA file for ever."""
    if bool(getattr(args, "tls_cert", None)) != bool(getattr(args, "tls_key", None)):
        raise ValueError("--tls-cert and --tls-key go together")
    markers = {"tls_cert": "CERTIFICATE", "tls_key": "PRIVATE KEY", "tls_ca": "CERTIFICATE", "auth_token_file": None,
               "ssl_certfile": "CERTIFICATE", "ssl_keyfile": "PRIVATE KEY"}
    for dest, marker in markers.items():
        path = getattr(args, dest, None)
        if path is None:
            continue
        flag = "--" + dest.replace("_", "-")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"{flag} {path!r}: {exc.strerror or exc}") from None
        if marker is not None and f"-----BEGIN {marker}" not in text and not (
                marker == "PRIVATE KEY" and "PRIVATE KEY-----" in text):
            raise ValueError(f"{flag} {path!r} is not a PEM file with a {marker.lower()}")


def _disable_by_batch_size(args: argparse.Namespace) -> int:
    """The verifier's speculation cap: as given, else 2 on a CPU (both services on one host's
    cores: measured in the README, "Speculation under load") and never on CUDA."""
    value = getattr(args, "speculative_disable_by_batch_size", 0)
    if value is None:
        return 2 if args.device == "cpu" else 0
    return int(value)


def _serve(args: argparse.Namespace, role: str) -> int:
    import torch

    from specdec.models import ModelSpec
    from specdec.serving import EngineConfig

    _check_env_values(args)
    _check_serving_files(args)
    try:  # the check random-model's and bench's --device flags run when read
        device_arg()(args.device)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--device {exc}") from None
    # key=value, so a log pipeline (or grep) can split fields; call lines add method, code, session.
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"ts=%(asctime)s role={role} level=%(levelname)s logger=%(name)s %(message)s")
    torch.set_num_threads(args.threads or _cpus())
    prefill_dtype = args.prefill_dtype
    if role == "verifier":
        # The target is one model: a copy for rows of >= 3 tokens would score verify rows (γ >= 2)
        # with other weights than 1-token rows, and greedy output would change with γ.
        if prefill_dtype not in ("auto", "none"):
            raise ValueError(f"--prefill-dtype {prefill_dtype}: a verifier scores every row with its own weights "
                             "(a copy for long rows would make its output depend on γ); the flag is the drafter's")
        prefill_dtype = "none"
    quantize, dtype = args.quantize, args.dtype
    if dtype is None:  # the drafter's default: float16, or whatever auto's int4 computes in
        dtype = "float16"
    elif quantize == "auto":
        quantize = "none"  # an explicit dtype is what the operator asked to run
    spec = ModelSpec(model=args.model, gguf_file=args.gguf_file, dtype=dtype, device=args.device,
                     quantize=quantize, max_model_len=args.max_model_len, cpu_linear=args.cpu_linear,
                     prefill_dtype=prefill_dtype, fast_path=args.fast_path)
    config = EngineConfig(max_draft_tokens=args.max_draft_tokens, max_sessions=args.max_sessions,
                          session_ttl_s=args.session_ttl_s, evict_after_idle_s=args.evict_after_idle_s,
                          kv_budget_mb=args.kv_budget_mb,
                          max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                          speculation_slots=getattr(args, "speculation_slots", 0),
                          sampler_backend=getattr(args, "sampler_backend", "auto"),
                          logprobs_mode=getattr(args, "logprobs_mode", "processed_logprobs"),
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          speculative_disable_by_batch_size=_disable_by_batch_size(args))
    ngram = {k: v for k, v in (("n_min", getattr(args, "ngram_min", None)), ("n_max", getattr(args, "ngram_max", None)))
             if v is not None}
    if ngram and args.backend != "ngram":
        raise ValueError("--ngram-min and --ngram-max go with --backend ngram")
    if role == "drafter" and args.backend == "ngram":
        # Quantizing asks for weights it does not load: refused, as other no-op flags are. (A dtype
        # is not: deployments pass one set of model flags to both services.)
        if args.quantize not in ("auto", "none"):
            raise ValueError(f"--quantize {args.quantize}: --backend ngram loads no weights (only the tokenizer)")
    if role == "drafter" and args.backend == "ngram":
        from drafter_service.ngram_engine import NgramDrafterEngine
        from drafter_service.server import run

        engine = NgramDrafterEngine(spec, config, **ngram)
    elif role == "drafter":
        from drafter_service.engine import DrafterEngine
        from drafter_service.server import run

        engine = DrafterEngine(spec, config)
    else:
        from verifier_service.engine import VerifierEngine
        from verifier_service.server import run

        engine = VerifierEngine(spec, config)
    from specdec_rpc.ops import freeze_heap

    freeze_heap(role)  # after the model's load and CUDA-graph capture: rounds never walk that heap again
    return run(engine, args.host, args.port, grace_s=args.grace_s, metrics_port=args.metrics_port,
               tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, auth_token_file=args.auth_token_file,
               **({"max_streams": args.max_streams} if role == "verifier" else {}))


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string that ended the text at its end")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    p.add_argument("--logit-bias", type=_bias_pair, nargs="+", default=[], metavar="ID:BIAS",
                   help="added to the raw logit of token ID, e.g. --logit-bias 30:-100 (vLLM's logit_bias)")
    p.add_argument("--allowed-token-ids", type=int, nargs="+", default=None,
                   help="only these tokens may be generated (vLLM's allowed_token_ids)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None,
                   help="top-N logprobs of each generated token: a line per token after the text (with --json, "
                        "in the result)")
    p.add_argument("--acceptance-method", default="rejection", choices=["rejection", "greedy", "typical"],
                   help="typical acceptance is not lossless")
    p.add_argument("--posterior-threshold", type=float, default=None, help="--acceptance-method typical (default 0.09)")
    p.add_argument("--posterior-alpha", type=float, default=None, help="--acceptance-method typical (default 0.3)")
    _add_proposal_args(p)
    p.add_argument("--num-speculative-tokens", type=gamma_arg, default="auto",
                   help="gamma, drafts per round, or 'auto' (default: per round in [0, 8], for goodput from the "
                        "measured acceptance and the load and step costs the services report)")
    p.add_argument("--fanout", type=positive("--fanout", zero=True), default=0,
                   help="speculation cache: the drafter pre-drafts the next round for its top-F bonus candidates "
                        "while the verifier works (0 = off)")
    add_decode_steps_arg(p)


def _add_proposal_args(p: argparse.ArgumentParser) -> None:
    """The proposal's wire form (generate and gateway): read by commands.proposal_format."""
    p.add_argument("--proposal", default=None, choices=["dense", "sparse", "ids"],
                   help="wire form of q (default: ids when greedy, else dense)")
    p.add_argument("--proposal-dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="dtype of q's probabilities on the wire (default float32; alone: a dense q of this dtype)")
    p.add_argument("--top-n", type=positive("--top-n"), default=None,
                   help="tokens kept by --proposal sparse (default 64; alone: a sparse q of this many)")


def _params(args: argparse.Namespace):
    from specdec.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                          include_stop_str_in_output=args.include_stop_str_in_output,
                          stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos,
                          min_tokens=args.min_tokens, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          logprobs=args.logprobs, acceptance_method=args.acceptance_method,
                          **{k: v for k, v in (("posterior_threshold", args.posterior_threshold),
                                               ("posterior_alpha", args.posterior_alpha)) if v is not None},
                          logit_bias=dict(args.logit_bias), allowed_token_ids=args.allowed_token_ids)


def _bias_pair(text: str) -> tuple[int, float]:
    """--logit-bias ID:BIAS."""
    token, sep, bias = text.partition(":")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes ID:BIAS, e.g. 30:-100, got {text!r}") from None


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_serving_files(args)  # a missing --auth-token-file named no flag
    if not args.target_only and not args.drafter:
        parser.error("argument --drafter: required unless --target-only")
    # Flags that would change nothing are refused, as bench's are, rather than silently ignored.
    from cli.commands import drafting_flags, generate_command

    if args.target_only and (drafting := drafting_flags(args)):
        parser.error(f"{', '.join(drafting)}: drafting flags, and --target-only drafts nothing")
    if args.acceptance_method != "typical" and (args.posterior_threshold, args.posterior_alpha) != (None, None):
        parser.error("--posterior-threshold and --posterior-alpha go with --acceptance-method typical")
    if args.proposal == "ids" and args.temperature > 0 and args.acceptance_method == "rejection":
        print("specdec generate: warning: --proposal ids at a temperature > 0 is exact but sends the drafter's argmax "
              "as a one-hot q: acceptance falls (dense or sparse keeps it)", file=sys.stderr)
    try:
        params = _params(args)
    except SpecDecError as exc:
        field = str(exc).split(":")[0].replace("_", "-")
        parser.error(f"argument --{field}: {exc}")

    return generate_command(args, params)


def _add_gateway_parser(sub) -> None:
    gw = sub.add_parser("gateway", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) "
                                        "over a drafter and a verifier")
    gw.add_argument("--drafter", action=AddressList,
                    help="HOST:PORT; repeat it or separate by commas for a pool (none: target-only decoding)")
    gw.add_argument("--verifier", action=AddressList,
                    help="HOST:PORT; repeat it or separate by commas for a pool (required, here or in the environment)")
    gw.add_argument("--host", default="127.0.0.1", help="HTTP address to bind (0.0.0.0 in a container)")
    gw.add_argument("--port", type=port("--port"), default=DEFAULT_PORTS["gateway"],
                    help="0 picks a free port")
    gw.add_argument("--api-key", default=None,
                    help="clients must send `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                         "(prefer $SPECDEC_GATEWAY_API_KEY: a flag shows in ps)")
    # vLLM's CORS flags, with its defaults: a browser page of any origin may call the API (the
    # API key, if any, still guards /v1/*)
    gw.add_argument("--allowed-origins", type=string_list("--allowed-origins"), default=("*",),
                    help='origins a browser may call from: a JSON list, as vLLM\'s, or comma-separated (default "*")')
    gw.add_argument("--allowed-methods", type=string_list("--allowed-methods"), default=("*",),
                    help='HTTP methods allowed cross-origin (default "*")')
    gw.add_argument("--allowed-headers", type=string_list("--allowed-headers"), default=("*",),
                    help='request headers allowed cross-origin (default "*")')
    gw.add_argument("--allow-credentials", action="store_true",
                    help="let cross-origin requests carry cookies and HTTP authentication")
    gw.add_argument("--served-model-name", nargs="+", default=None,
                    help="model names clients may ask for (the first is reported); default: the verifier's model name "
                         "without its runtime tag, as /v1/models lists it (a folder or hub id: --model as given; the "
                         "default: embedded:SmolLM2-135M-Instruct)")
    gw.add_argument("--num-speculative-tokens", type=gamma_arg, default="auto",
                    help="gamma, drafts per round, or 'auto' (adaptive per round in [0, 8]; default)")
    gw.add_argument("--fanout", type=positive("--fanout", zero=True), default=0,
                    help="speculation cache: the drafter pre-drafts the next round for its top-F bonus candidates")
    add_decode_steps_arg(gw)
    _add_proposal_args(gw)
    gw.add_argument("--max-request-bytes", type=positive("--max-request-bytes", zero=True),
                    default=None,
                    help="a larger request body gets 413 request_too_large before it is read whole "
                         "(default 32 MiB; 0: no limit)")
    gw.add_argument("--max-concurrent-requests", type=positive("--max-concurrent-requests"), default=64,
                    help="generations run at once, each with a session on each side; more requests "
                         "wait for a slot, up to --timeout-s (then 503 server_busy)")
    gw.add_argument("--timeout-s", type=positive("--timeout-s", float, maximum=MAX_TIMEOUT_S), default=60.0,
                    help="deadline of every upstream call")
    gw.add_argument("--recovery-timeout-s", type=positive("--recovery-timeout-s", float, maximum=MAX_TIMEOUT_S),
                    default=10.0,
                    help="how long a request waits for a lost verifier to come back, or for the first "
                         "connection while the gateway is still connecting, before it fails with 503")
    add_client_security_args(gw)
    gw.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS (with --ssl-keyfile)")
    gw.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    gw.add_argument("--grace-s", type=positive("--grace-s", float, zero=True), default=5.0,
                    help="on SIGTERM, let requests in flight finish for this long, then cancel them")
    gw.add_argument("--log-level", type=log_level, default="INFO")
    # Only SPECDEC_GATEWAY_*: the shared SPECDEC_PORT, SPECDEC_TLS_CA, ... configure the services'
    # server side and mean something else here.
    _apply_env_defaults(gw, "gateway", shared=False)


def build_parser(bench: bool = True) -> argparse.ArgumentParser:
    """bench=False leaves out `specdec bench` (whose engine benchmarks import torch)."""
    parser = _Parser(prog="specdec", description="Distributed speculative decoding over gRPC")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for role in ("drafter", "verifier"):
        p = sub.add_parser(role, help=f"serve the {role} until SIGINT / SIGTERM")
        _add_model_args(p, role)
        _add_ops_args(p)
        _apply_env_defaults(p, role)

    _add_gateway_parser(sub)

    g = sub.add_parser("generate", help="generate text through a drafter and a verifier")
    g.set_defaults(_parser=g)  # its own errors read "specdec generate: error: ...", as argparse's do
    g.add_argument("--drafter", action=AddressList,
                   help="HOST:PORT; repeat it or separate by commas for a pool (optional with --target-only)")
    g.add_argument("--verifier", action=AddressList, required=True,
                   help="HOST:PORT; repeat it or separate by commas for a pool")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--target-only", action="store_true", help="verifier alone (zero drafts): the baseline")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--timeout-s", type=positive("--timeout-s", float, maximum=MAX_TIMEOUT_S), default=60.0,
                   help="deadline of every call")
    g.add_argument("--recovery-timeout-s", type=positive("--recovery-timeout-s", float, maximum=MAX_TIMEOUT_S),
                   default=60.0, help="how long to wait for a lost verifier (or another of its pool) before failing")
    add_client_security_args(g)
    _sampling_args(g)

    h = sub.add_parser("health", help="gRPC health check of a service: exit 0 when SERVING (container healthchecks); "
                                      "--url: HTTP check of the gateway, exit 0 on 200")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="HOST:PORT of a drafter or verifier")
    target.add_argument("--url", help="HTTP URL of the gateway's health, e.g. http://127.0.0.1:8000/health")
    h.add_argument("--service", default="", help="service name, e.g. specdec.v1.Verifier ('' = the whole server)")
    h.add_argument("--timeout-s", type=positive("--timeout-s", float, maximum=MAX_TIMEOUT_S), default=5.0)
    add_client_security_args(h, auth=False)
    # In a service's container its own SPECDEC_TLS_CA / _CERT / _KEY configure the healthcheck too.
    _apply_env_defaults(h, "health")

    d = sub.add_parser("demo", help="start both services locally, compare speculative and target-only, then put "
                                    "the OpenAI gateway in front of them")
    d.add_argument("--prompt", action="append", default=None, help="prompt (repeatable); default: built-in set")
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--num-speculative-tokens", type=gamma_arg, default="auto",
                   help="gamma, or 'auto' (default: adaptive per round in [0, 8])")
    d.add_argument("--drafter-args", default="", help="extra arguments for `specdec drafter`, e.g. '--quantize int8'")
    d.add_argument("--verifier-args", default="", help="extra arguments for `specdec verifier`")
    d.add_argument("--gateway-args", default="",
                   help="extra arguments for `specdec gateway`, e.g. '--port 8000' (default: a free port)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--keep-running", action="store_true",
                   help="keep the services and the gateway up after the demo (for the printed curl line) until Ctrl-C")

    r = sub.add_parser("random-model", help="write a random-weight Llama of a bench-engine preset as a model "
                                            "directory (GPU end-to-end runs without weights)")
    r.add_argument("--preset", required=True, help="target-1.5b, drafter-270m, smollm2-135m or tiny")
    r.add_argument("--out", required=True, help="directory to write (config, safetensors, tokenizer)")
    r.add_argument("--overwrite", action="store_true", help="replace the model already in --out")
    r.add_argument("--tokenizer", default="embedded", help="model whose tokenizer (and vocabulary size) to use")
    r.add_argument("--seed", type=int, default=0, help="same preset and seed: same weights (a copy drafter)")
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    r.add_argument("--device", type=device_arg(), default="cpu", help="where to initialize, and to run --pair's calibration "
                                                   "(cuda: seconds for 1.5B)")
    r.add_argument("--pair", action="store_true",
                   help="write a target and a cheap drafter with tunable greedy agreement: OUT/target, OUT/drafter "
                        "(its first layers, the same embedding, final norm and head) and OUT/pair.json "
                        "(construction: bench/synthetic.py); needs --divergence or --acceptance")
    r.add_argument("--drafter-layers", type=int, default=None,
                   help="--pair: the drafter's layers (default: weight bytes per step closest to 1/5 of the target's)")
    knob = r.add_mutually_exclusive_group()
    knob.add_argument("--divergence", type=float, default=None,
                      help="--pair: scale of the target's later layers' output projections (0: the drafter's logits "
                           "exactly; agreement falls towards 0 as it grows)")
    knob.add_argument("--acceptance", type=float, default=None,
                      help="--pair: the teacher-forced greedy agreement (per-position acceptance) to calibrate "
                           "--divergence for, in [0, 1], e.g. 0.3, 0.6 or 0.9 (a search of 3-6 forwards of the "
                           "later layers on --device)")

    if bench:
        from bench.args import add_bench_parser  # lazy: the client side imports grpc, the core does not

        add_bench_parser(sub)
    return parser


def _random_pair(args: argparse.Namespace) -> int:
    """`specdec random-model --pair`: write the pair, print what pair.json records."""
    import torch

    from bench.synthetic import save_pair

    info = save_pair(args.preset, args.out, drafter_layers=args.drafter_layers, divergence=args.divergence,
                     acceptance=args.acceptance, seed=args.seed, dtype=getattr(torch, args.dtype), device=args.device,
                     tokenizer=args.tokenizer)
    rates = ", ".join(f"γ={g}: {r:.2f}" for g, r in info.acceptance_rate_at_gamma.items())
    print(f"wrote {args.preset} pair to {args.out}/target and {args.out}/drafter: drafter {info.drafter_layers} of "
          f"{info.target_layers} layers, bytes per step {info.drafter_bytes_per_step / 1e6:.1f} / "
          f"{info.target_bytes_per_step / 1e6:.1f} MB (ratio {info.bytes_ratio:.3f})")
    print(f"divergence {info.divergence:.4g}: greedy agreement {info.greedy_agreement:.3f} "
          f"({info.calibration_positions} teacher-forced positions, {info.calibration_s:.1f} s); "
          f"accepted/proposed if positions were independent: {rates}")
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt would be."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# SIGTERM: `timeout`, `docker stop`, a compose run's teardown; SIGHUP: the terminal closed (an
# ssh session dropped). Either killed the process outright, its sessions left to the TTL.
_ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """A client command (generate, bench, demo) ends on SIGTERM or SIGHUP as on Ctrl-C: its
    generations stop and close their sessions, which the services otherwise held until their
    TTL. The services drain on SIGTERM themselves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise _Terminated(signum)

    previous = {signum: signal.signal(signum, terminate) for signum in _ENDING_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_COMMANDS_WITHOUT_BENCH = frozenset({"drafter", "verifier", "gateway", "generate", "health", "demo", "random-model"})


def console() -> None:
    """The `specdec` program (and `python -m cli`): main() as the process, which then exits
    without the interpreter's teardown. By then every command has closed what it opened (a
    service drained and closed its sessions, a client closed its sessions and channels, files
    are written), and torch's and the model's finalizers took 1.3-1.6 s of every stop on a
    2-core host (a service's restart waits on it; every `specdec generate` took 1.3 s after
    its output to exit) while freeing nothing that the exit does not."""
    status = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, or a stream closed
            stream.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    # `specdec bench`'s parser imports torch (its engine and sampler benchmarks): built only for
    # bench, or where the command is not known yet (help, a typo). `specdec health` is a
    # container's healthcheck, run every few seconds beside a busy service: torch took 7-13 s on
    # a loaded 2-core host, past compose's 5 s healthcheck timeout; a flag mistake of any other
    # command is told a second sooner.
    first = (sys.argv[1:] if argv is None else argv)[:1]
    parser = build_parser(bench=not first or first[0] not in _COMMANDS_WITHOUT_BENCH)
    args = parser.parse_args(argv)
    try:
        if args.command in ("drafter", "verifier"):
            return _serve(args, args.command)
        if args.command == "gateway":
            from cli.commands import gateway_command

            _check_env_values(args)
            _check_serving_files(args)
            if not args.verifier:
                raise ValueError("--verifier (or $SPECDEC_GATEWAY_VERIFIER) is required")
            return gateway_command(args)
        if args.command == "generate":
            with _sigterm_as_interrupt():
                return _generate(args, args._parser)
        if args.command == "health":
            from cli.commands import health_command

            return health_command(args)
        if args.command == "demo":
            from cli.demo import run_demo

            with _sigterm_as_interrupt():
                return run_demo(args)
        if args.command == "random-model":
            import torch

            if os.path.exists(args.out) and not os.path.isdir(args.out):
                raise ValueError(f"--out {args.out!r} is a file; it must name a folder (new or existing)")
            # a model of one's own, maybe (a pair's target sits in OUT/target)
            held = (os.path.join(args.out, *sub, "config.json") for sub in ((), ("target",)))
            if not args.overwrite and any(map(os.path.exists, held)):
                raise ValueError(f"--out {args.out!r} already holds a model; pass --overwrite to replace it")
            if args.pair:
                return _random_pair(args)
            if args.divergence is not None or args.acceptance is not None or args.drafter_layers is not None:
                raise ValueError("--divergence, --acceptance and --drafter-layers need --pair")
            from bench.engine import save_random_model

            n = save_random_model(args.preset, args.out, args.tokenizer, args.seed, getattr(torch, args.dtype),
                                  args.device)
            print(f"wrote {args.preset} ({n / 1e6:.0f}M parameters, random, seed {args.seed}) to {args.out}")
            return 0
        if args.command == "bench":
            from bench.args import run_bench

            with _sigterm_as_interrupt():
                return run_bench(args)
    except _Terminated as ended:
        return 128 + ended.signum
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Its reader left (`specdec generate ... | head`): end quietly, as a filter killed by
        # SIGPIPE does (the generation closed its sessions on the way out). What is still
        # buffered for stdout goes nowhere, so the interpreter's exit does not fail on it too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (SpecDecError, ValueError) as exc:
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing file, a port in use, an unreachable host: the user's to fix
        logging.getLogger("specdec").debug("specdec %s failed", args.command, exc_info=True)
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        import grpc

        httpx = sys.modules.get("httpx")  # imported only by commands that speak HTTP (bench --backend openai)
        if httpx is not None and isinstance(exc, httpx.HTTPError):
            print(f"specdec {args.command}: error: {_http_error(exc)}", file=sys.stderr)
            return 1
        if not isinstance(exc, grpc.RpcError):
            raise
        # a service that is down or refused the request (bench, demo): its status, not a traceback
        logging.getLogger("specdec").debug("specdec %s failed", args.command, exc_info=True)
        print(f"specdec {args.command}: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 1


def _http_error(exc) -> str:
    """One line for an httpx error: the status and the server's own message (an OpenAI error
    body's), or what failed on the way (connection refused, a timeout)."""
    response = getattr(exc, "response", None)  # HTTPStatusError's; a RequestError has none
    if response is None:
        try:
            where = f"{exc.request.method} {exc.request.url}: "
        except RuntimeError:  # an error raised outside a request
            where = ""
        return f"{where}{type(exc).__name__}: {exc}"
    try:
        message = response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not an OpenAI error body
        message = response.text[:200]
    return f"{response.request.method} {response.request.url}: HTTP {response.status_code}: {message}"


if __name__ == "__main__":
    sys.exit(main())
