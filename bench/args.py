"""`specdec bench serve|compare|compare-results|sweep|peer|verifier|sampler|engine`: arguments, then a call into a module.

Only argparse at module level: `cli` builds this parser for every command.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from specdec.argtypes import (
    MAX_TIMEOUT_S, add_client_security_args, add_decode_steps_arg, output_file, positive as _positive, positive_list,
)


def _dataset(text: str) -> str:
    """An argparse type: the shipped set's name or a file whose prompts load (checked before any
    connection, not after a server was reached)."""
    if text in ("specbench", "random"):
        return text
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is {'a directory' if os.path.isdir(text) else 'no file'}; give "
                                         "'specbench', 'random', a .jsonl file or a ShareGPT JSON file")
    from bench.datasets import load_dataset

    try:
        load_dataset(text)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--metric-percentiles takes numbers, e.g. 50,95,99.9; got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return values


def _latency_names(text: str) -> tuple[str, ...]:
    from bench.serve import LATENCY_METRICS

    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names or any(n not in LATENCY_METRICS for n in names):
        raise argparse.ArgumentTypeError(f"--percentile-metrics takes {','.join(LATENCY_METRICS)}; got {text!r}")
    return names


def _goodput_slo(text: str) -> tuple[str, float]:
    from bench.serve import SLO_METRICS

    name, sep, value = text.partition(":")
    if not sep or name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_METRICS)}, got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--goodput {name}: milliseconds must be a number, got {value!r}") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"--goodput {name}: milliseconds must be >= 0, got {value!r}")
    return name, ms


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rate must be a number or inf, got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be > 0 (inf sends all at once), got {text!r}")
    return rate


def _gamma(text: str) -> int | str:
    return text if text == "auto" else _positive("--num-speculative-tokens")(text)


def _add_dataset_args(p: argparse.ArgumentParser, num_prompts: int, max_tokens: int) -> None:
    p.add_argument("--dataset", type=_dataset, default="specbench",
                   help="'specbench' (the shipped 126 prompts, 7 categories), 'random' (vLLM's: random token ids, "
                        "--random-*), a ShareGPT JSON file, or a .jsonl file of {\"prompt\": ...} lines (vLLM's "
                        "custom dataset)")
    # Defaults None, so that a --random-* flag without --dataset random is refused instead of
    # silently ignored (RandomDataset holds vLLM's defaults: 1024 in, 128 out).
    p.add_argument("--random-input-len", type=_positive("--random-input-len"), default=None,
                   help="--dataset random: prompt tokens after the prefix (default 1024)")
    p.add_argument("--random-output-len", type=_positive("--random-output-len"), default=None,
                   help="--dataset random: each request's max_tokens, instead of --max-tokens (default 128)")
    p.add_argument("--random-range-ratio", type=float, default=None,
                   help="--dataset random: lengths uniform in [len·(1 - r), len·(1 + r)], r in [0, 1) (default 0)")
    p.add_argument("--random-prefix-len", type=int, default=None,
                   help="--dataset random: random tokens every prompt starts with (default 0)")
    p.add_argument("--num-prompts", type=_positive("--num-prompts"), default=num_prompts)
    # Default None (resolved in run_bench): --dataset random takes --random-output-len instead,
    # and an explicit --max-tokens beside it is refused rather than silently ignored.
    p.add_argument("--max-tokens", type=_positive("--max-tokens"), default=None,
                   help=f"each request's max_tokens (default {max_tokens}; --dataset random: --random-output-len)")
    p.set_defaults(max_tokens_default=max_tokens)
    p.add_argument("--seed", type=int, default=0, help="prompt order, arrivals and per-request sampling seeds")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the chat template (default on; multi-turn prompts are sent as chats)")


def _add_workload_args(p: argparse.ArgumentParser, verifier_required: bool = True) -> None:
    from specdec.argtypes import AddressList

    add_client_security_args(p)  # the services' TLS and token; --tls-ca is also the HTTPS CA of --backend openai
    p.add_argument("--drafter", action=AddressList,
                   help="HOST:PORT; repeat it or separate by commas for a pool (not needed with --target-only)")
    p.add_argument("--verifier", action=AddressList, required=verifier_required,
                   help="HOST:PORT; repeat it or separate by commas for a pool")
    _add_dataset_args(p, num_prompts=24, max_tokens=64)
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    # Finite: a shape of inf made NaN gaps that sent every request at once, and Infinity in the JSON.
    p.add_argument("--burstiness", type=_positive("--burstiness", float, maximum=1e6), default=1.0,
                   help="Gamma shape of the inter-arrival times (1 = Poisson; larger: more even), as vLLM")
    p.add_argument("--max-concurrency", type=_positive("--max-concurrency"), default=None,
                   help="most requests in flight (default: no bound)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--num-speculative-tokens", type=_gamma, default="auto",
                   help="gamma, or 'auto' (default: adaptive per round in [0, 8], goodput under the reported load)")
    p.add_argument("--fanout", type=_positive("--fanout", zero=True), default=0,
                   help="speculation cache: the drafter pre-drafts the next round for its top-F bonus candidates")
    add_decode_steps_arg(p)
    p.add_argument("--timeout-s", type=_positive("--timeout-s", float, maximum=MAX_TIMEOUT_S), default=60.0,
                   help="deadline of every call")
    p.add_argument("--duration-limit-s", type=_positive("--duration-limit-s", float, maximum=MAX_TIMEOUT_S),
                   default=None,
                   help="hard bound on the run: unsent requests fail, in-flight ones stop after their round")
    p.add_argument("--goodput", type=_goodput_slo, nargs="+", action="extend", default=[], metavar="NAME:MS",
                   help="SLOs in ms, e.g. --goodput ttft:500 tpot:50 e2el:10000")
    p.add_argument("--metric-percentiles", type=_percentiles, default=(),
                   help="percentiles to add to p90 and p99, comma-separated, e.g. 50,95,99.9 (vLLM's flag)")
    p.add_argument("--percentile-metrics", type=_latency_names, default=None,
                   help="latencies whose percentiles are printed: ttft,tpot,itl,e2el (default all; the JSON has all)")
    p.add_argument("--warmup-requests", type=_positive("--warmup-requests", zero=True), default=1,
                   help="unmeasured requests before the run")
    p.add_argument("--result-json", type=output_file, default=None, help="write the result here")
    p.add_argument("--plot", type=output_file, default=None, help="write a PNG here")
    p.add_argument("--disable-tqdm", action="store_true")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="load-test the services (serve, sweep) or compare with HF (peer)")
    sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=type(bench))

    s = sub.add_parser("serve", help="one vLLM-style serving benchmark run")
    _add_workload_args(s, verifier_required=False)
    s.add_argument("--backend", default="specdec", choices=["specdec", "openai"],
                   help="specdec: our services over gRPC (--drafter, --verifier); openai: any OpenAI-compatible "
                        "server over streaming HTTP (--base-url), e.g. `specdec gateway`, vLLM, llama-server")
    s.add_argument("--base-url", default=None, help="--backend openai: the server's root, e.g. http://127.0.0.1:8000")
    s.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
                   help="--backend openai (default: chat completions with --chat, else completions)")
    s.add_argument("--model", default=None, help="--backend openai: model name (default: the first of /v1/models)")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="--backend openai: bearer key (default $OPENAI_API_KEY)")
    s.add_argument("--target-only", action="store_true", help="the baseline: verifier alone, drafter never contacted")
    s.add_argument("--baseline-json", default=None,
                   help="--result-json of a --target-only run of the same workload (gives system efficiency)")

    c = sub.add_parser("compare", help="one workload, several client configurations (gamma, auto, fanout), one run")
    _add_workload_args(c)
    c.add_argument("--variants", nargs="+", required=True, metavar="VARIANT",
                   help="'target-only' or 'gamma=G[,fanout=F]' (G an integer or auto), run in this order; "
                        "target-only is added first when missing")
    c.add_argument("--repeats", type=_positive("--repeats"), default=1,
                   help="run the variant list this many times in rotated order; report each variant's median repeat")

    r = sub.add_parser("compare-results", help="side-by-side table of `bench serve --result-json` files "
                                                "(e.g. our gateway vs a vLLM server on the same prompts)")
    r.add_argument("results", nargs="+", metavar="RESULT_JSON", help="two or more result files; the first is the "
                                                                      "reference of the ratio column")
    r.add_argument("--labels", nargs="+", default=None, help="column names (default: the file names)")

    w = sub.add_parser("sweep", help="serve at several concurrencies or rates, speculative and target-only")
    _add_workload_args(w)
    w.add_argument("--concurrency", type=positive_list("--concurrency"), default=None,
                   help="comma-separated max concurrencies, e.g. 1,2,4")
    w.add_argument("--request-rates", type=positive_list("--request-rates", float), default=None,
                   help="comma-separated request rates, e.g. 1,2,inf")
    w.add_argument("--latency", default="tpot", choices=["tpot", "e2el"], help="x axis of the plot")
    w.add_argument("--warmup-wave", action=argparse.BooleanOptionalAction, default=True,
                   help="before each measured run, an unmeasured wave of requests at the point's concurrency and "
                        "max_tokens (default on), so new batch and width shapes are not paid inside the measurement")

    p = sub.add_parser("peer", help="tokens/s of ours (gRPC) vs transformers' assisted generation")
    p.add_argument("--drafter", help="HOST:PORT (with --verifier; default: start both services here)")
    p.add_argument("--verifier", help="HOST:PORT")
    _add_dataset_args(p, num_prompts=3, max_tokens=64)
    p.add_argument("--num-speculative-tokens", type=positive_list("--num-speculative-tokens"), default=[4],
                   help="gamma, or a comma-separated list, e.g. 4,8")
    p.add_argument("--threads", type=_positive("--threads"), default=2, help="torch threads of the HF runs")
    p.add_argument("--service-threads", type=_positive("--service-threads"), default=2,
                   help="torch threads of the services this command starts")
    p.add_argument("--result-json", type=output_file, default=None)

    v = sub.add_parser("verifier", help="verifier throughput vs concurrency (continuous batching)")
    v.add_argument("--verifier", default=None, help="HOST:PORT (default: start one here)")
    v.add_argument("--concurrency", type=positive_list("--concurrency"), default=[1, 4, 16, 32],
                   help="comma-separated; the first is the baseline")
    v.add_argument("--num-speculative-tokens", type=int, default=4, help="random drafts per round (gamma)")
    v.add_argument("--prompt-len", type=_positive("--prompt-len"), default=64)
    v.add_argument("--seconds", type=_positive("--seconds", float), default=10.0, help="measured time per level")
    v.add_argument("--max-batch-size", type=_positive("--max-batch-size"), default=32)
    v.add_argument("--max-wait-ms", type=float, default=10.0)
    v.add_argument("--service-threads", type=_positive("--service-threads"), default=2)
    v.add_argument("--front", choices=("unary", "batched", "stream"), default="unary",
                   help="unary: one thread and one Verify call per session and round; batched: one client "
                        "thread sends every session's round of a step in one VerifyBatch call; stream: the same "
                        "steps as messages of one VerifyStream")
    v.add_argument("--batched", dest="front", action="store_const", const="batched", help="= --front batched")
    v.add_argument("--proposal", choices=("ids", "sparse", "dense"), default="ids",
                   help="ids: greedy rounds (default); sparse (top --top-n) or dense (float32 [γ, V]): sampled "
                        "rounds (temperature 1) whose drafts come with the proposal they were drawn from")
    v.add_argument("--top-n", type=_positive("--top-n"), default=64, help="tokens of a --proposal sparse row")
    v.add_argument("--empty-calls", type=int, default=500,
                   help="unary health checks timed first: what a gRPC call alone costs on this host (0 = skip)")
    v.add_argument("--json", type=output_file, default=None)
    add_client_security_args(v)

    from bench import engine as bench_engine, sampler as bench_sampler  # torch is imported by now anyway

    bench_sampler.add_args(sub.add_parser("sampler", help="batched sampler cost and bytes per proposal form "
                                                          "(no services)"))
    e = sub.add_parser("engine", help="ms per forward step: eager transformers vs the fast path, random weights "
                                      "(no services)")
    bench_engine.add_args(e)
    return bench


def _random_dataset(args: argparse.Namespace):
    from bench.datasets import RANDOM, RandomDataset

    given = {f: value for f in ("input_len", "output_len", "range_ratio", "prefix_len")
             if (value := getattr(args, f"random_{f}")) is not None}
    if args.dataset != RANDOM and given:
        raise ValueError(f"{', '.join('--random-' + f.replace('_', '-') for f in given)} go with --dataset random "
                         f"(the dataset is {args.dataset!r})")
    return RandomDataset(**given)


def _workload(args: argparse.Namespace, target_only: bool):
    from bench.serve import WorkloadConfig
    from specdec.sampling import SamplingParams
    from specdec_rpc.ops import client_security

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    tls, auth_token = client_security(args)
    return WorkloadConfig(
        tls=tls, auth_token=auth_token,
        verifier=args.verifier, drafter=args.drafter, dataset=args.dataset, num_prompts=args.num_prompts,
        random_dataset=_random_dataset(args),
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        seed=args.seed, params=params, num_speculative_tokens=args.num_speculative_tokens, chat=args.chat,
        fanout=args.fanout, decode_steps=args.decode_steps,
        target_only=target_only, timeout_s=args.timeout_s, duration_limit_s=args.duration_limit_s,
        goodput_slos_ms=dict(args.goodput), warmup_requests=args.warmup_requests,
        metric_percentiles=args.metric_percentiles,
        **({"percentile_metrics": args.percentile_metrics} if args.percentile_metrics else {}),
        show_progress=not args.disable_tqdm,
    )


def _serve(args: argparse.Namespace) -> int:
    from bench import serve

    if args.backend == "openai":
        return _serve_openai(args)
    if args.base_url or args.model or args.endpoint:
        raise ValueError("--base-url, --model and --endpoint go with --backend openai")
    if not args.verifier:
        raise ValueError("--verifier is required (or --backend openai --base-url URL)")
    if not args.target_only and not args.drafter:
        raise ValueError("--drafter is required unless --target-only")
    baseline = None
    if args.baseline_json:
        if args.target_only:
            raise ValueError("--baseline-json compares a speculative run with a target-only one; drop --target-only")
        baseline = serve.load_result(args.baseline_json)
        if baseline.get("mode") != "target-only":
            raise ValueError(f"--baseline-json {args.baseline_json} is not a --target-only result")
    config = _workload(args, args.target_only)
    if baseline is not None:  # before the run: what the arguments already say
        _check_baseline(baseline, serve.workload_keys(config))
    result = serve.run_serve(config, baseline=baseline)
    if baseline is not None:  # the prompts the dataset gave (it may hold fewer than asked)
        _check_baseline(baseline, result, ("num_prompts", "verifier_model"))  # what the run found
    print(serve.format_result(result))
    if args.result_json:
        serve.write_json(result, args.result_json)
    if args.plot:
        from bench.plot import plot_serve

        plot_serve(result, args.plot)
    return 0 if result["completed"] else 1


def _check_baseline(baseline: dict, run: dict, keys=None) -> None:
    differs = [k for k in (keys or run) if baseline.get(k) != run.get(k)]
    if differs:
        raise ValueError(f"--baseline-json ran a different workload ({', '.join(differs)} differ); "
                         "its speedup and efficiency would be meaningless")


def _serve_openai(args: argparse.Namespace) -> int:
    from bench import serve
    from bench.openai_backend import OpenAITarget, run_serve_openai

    if not args.base_url:
        raise ValueError("--backend openai needs --base-url URL")
    if args.verifier or args.drafter or args.target_only or args.baseline_json:
        raise ValueError("--backend openai measures the server at --base-url: drop --verifier, --drafter, "
                         "--target-only and --baseline-json")
    if args.num_speculative_tokens != "auto" or args.fanout:  # nothing sends them: the server speculates as set up
        raise ValueError("--backend openai: the server at --base-url decides its speculation; drop "
                         "--num-speculative-tokens and --fanout (set them on the gateway or server)")
    target = OpenAITarget(base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                          tls_ca=args.tls_ca)
    result = run_serve_openai(_workload(args, False), target)
    print(serve.format_result(result))
    if args.result_json:
        serve.write_json(result, args.result_json)
    if args.plot:
        from bench.plot import plot_serve

        plot_serve(result, args.plot)
    return 0 if result["completed"] else 1


def _compare_results(args: argparse.Namespace) -> int:
    from bench.compare_results import format_results_table, load_results

    if len(args.results) < 2:
        raise ValueError("compare-results needs at least two result files")
    if args.labels is not None and len(args.labels) != len(args.results):
        raise ValueError(f"--labels names {len(args.labels)} columns for {len(args.results)} files")
    print(format_results_table(load_results(args.results), args.labels))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from bench import serve
    from bench.compare import format_compare, parse_variant, run_compare

    for v in args.variants:
        parse_variant(v)  # refuse a bad variant before any run
    if len(set(args.variants)) < len(args.variants):  # one row each: a repeat overwrote the first's runs
        raise ValueError(f"--variants lists one twice: {' '.join(args.variants)}; use --repeats to run one again")
    if not args.drafter:
        raise ValueError("--drafter is required (the variants run speculative decoding)")
    result = run_compare(_workload(args, False), args.variants, repeats=args.repeats)
    print(format_compare(result))
    if args.result_json:
        serve.write_json(result, args.result_json)
    return 0 if all(v["completed"] for v in result["variants"]) else 1


def _sweep(args: argparse.Namespace) -> int:
    from bench import serve
    from bench.sweep import format_sweep, run_sweep

    if not args.drafter:
        raise ValueError("--drafter is required (a sweep runs speculative and target-only)")
    if args.concurrency and args.max_concurrency is not None:
        # each point runs at its own concurrency: a --max-concurrency beside them was dropped unseen
        raise ValueError("--max-concurrency goes with --request-rates (a bound on every rate's run); "
                         "--concurrency already sets each point's")
    if args.request_rates and args.request_rate != math.inf:  # the same for a rate beside the rates
        raise ValueError("--request-rate goes with --concurrency (every concurrency point's arrivals); "
                         "--request-rates already sets each point's")
    result = run_sweep(_workload(args, False), concurrency=args.concurrency or [], request_rates=args.request_rates or [],
                       warmup=args.warmup_wave)
    print(format_sweep(result))
    if args.result_json:
        serve.write_json(result, args.result_json)
    if args.plot:
        from bench.plot import plot_sweep

        plot_sweep(result["points"], args.plot, latency=args.latency)
    return 0 if all(p["speculative"]["completed"] and p["target_only"]["completed"] for p in result["points"]) else 1


def _peer(args: argparse.Namespace) -> int:
    from bench import serve
    from bench.peer import format_peer, run_peer
    if bool(args.drafter) != bool(args.verifier):
        raise ValueError("give both --drafter and --verifier, or neither (then both are started here)")
    _random_dataset(args)  # refuses --random-* flags: peer runs text datasets
    result = run_peer(dataset=args.dataset, num_prompts=args.num_prompts, max_tokens=args.max_tokens, gammas=args.num_speculative_tokens,
                      seed=args.seed, chat=args.chat, threads=args.threads, service_threads=args.service_threads,
                      drafter=args.drafter, verifier=args.verifier)
    print(format_peer(result))
    if args.result_json:
        serve.write_json(result, args.result_json)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from bench import verifier
    from bench import engine as bench_engine, sampler as bench_sampler

    if hasattr(args, "max_tokens_default"):
        from bench.datasets import RANDOM

        if args.max_tokens is not None and getattr(args, "dataset", None) == RANDOM:
            raise ValueError("--max-tokens does not apply to --dataset random: each request's max_tokens is "
                             "--random-output-len (default 128)")
        if args.max_tokens is None:
            args.max_tokens = args.max_tokens_default
    commands = {"serve": _serve, "compare-results": _compare_results,
                "compare": _compare, "sweep": _sweep, "peer": _peer, "verifier": verifier.run,
                "sampler": bench_sampler.run, "engine": bench_engine.run}
    return commands[args.bench_command](args)
