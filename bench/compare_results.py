"""`specdec bench compare-results A.json B.json [...]`: `bench serve` results side by side.

Typical use: the same workload measured through the gRPC client and through the gateway
(what HTTP costs), or our gateway against a vLLM / llama.cpp server on the same prompts.
Each column is one file; with two files a last column gives B / A. Runs of different
workloads (dataset, prompts, sampling, arrivals, concurrency) are compared anyway, under
a warning naming what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from bench.serve import _fmt, load_result

WORKLOAD_KEYS = ("dataset", "random_dataset", "num_prompts", "chat", "sampling", "request_rate", "burstiness",
                 "max_concurrency", "duration_limit_s", "seed")

# (label, result key, digits); None key = a section title.
ROWS: tuple[tuple[str, str | None, int], ...] = (
    ("completed requests", "completed", 0),
    ("failed requests", "failed", 0),
    ("duration (s)", "duration", 2),
    ("request throughput (req/s)", "request_throughput", 3),
    ("output throughput (tok/s)", "output_throughput", 2),
    ("output tok/s per request", "output_tokens_per_request_s", 2),
    ("total input tokens", "total_input_tokens", 0),
    ("total output tokens", "total_output_tokens", 0),
    ("TTFT", None, 0),
    ("  mean (ms)", "mean_ttft_ms", 1),
    ("  median (ms)", "median_ttft_ms", 1),
    ("  p99 (ms)", "p99_ttft_ms", 1),
    ("TPOT", None, 0),
    ("  mean (ms)", "mean_tpot_ms", 1),
    ("  median (ms)", "median_tpot_ms", 1),
    ("  p99 (ms)", "p99_tpot_ms", 1),
    ("ITL (per streamed chunk)", None, 0),
    ("  mean (ms)", "mean_itl_ms", 1),
    ("  median (ms)", "median_itl_ms", 1),
    ("  p99 (ms)", "p99_itl_ms", 1),
    ("E2EL", None, 0),
    ("  mean (ms)", "mean_e2el_ms", 1),
    ("  median (ms)", "median_e2el_ms", 1),
    ("  p99 (ms)", "p99_e2el_ms", 1),
    ("speculative", None, 0),
    ("  acceptance rate", "acceptance_rate", 3),
    ("  tokens per round", "mean_tokens_per_round", 2),
    ("  verify time per round (ms)", "mean_verify_time_per_round_ms", 1),
)


def load_results(paths: Sequence[str]) -> list[tuple[str, dict]]:
    return [(path, load_result(path)) for path in paths]


def workload_differences(results: Sequence[dict]) -> list[str]:
    ref = results[0]
    return [k for k in WORKLOAD_KEYS if any(r.get(k) != ref.get(k) for r in results[1:])]


def _target(result: dict) -> str:
    if result.get("backend") == "openai":
        return f"{result.get('base_url')}{result.get('endpoint') or ''}"
    return f"gRPC {result.get('verifier')}" + (f" + {result['drafter']}" if result.get("drafter") else "")


def format_results_table(results: Sequence[tuple[str, dict]], labels: Sequence[str] | None = None) -> str:
    names = list(labels) if labels else [Path(path).stem for path, _ in results]
    data = [r for _, r in results]
    ratio = len(data) == 2
    width = max(12, *(len(n) + 2 for n in names))
    header = f"{'':<30}" + "".join(f"{n:>{width}}" for n in names) + (f"{'B / A':>9}" if ratio else "")
    lines = [header, "-" * len(header)]
    for r, name in zip(data, names):
        kind = r.get("backend", "specdec") + (f" {r['mode']}" if r.get("mode") not in (None, r.get("backend")) else "")
        lines.append(f"{name}: {kind}, {_target(r)}, "
                     f"model {r.get('verifier_model')}, gamma {r.get('num_speculative_tokens')}")
    lines.append("-" * len(header))
    for label, key, digits in ROWS:
        if key is None:
            lines.append(label)
            continue
        values = [r.get(key) for r in data]
        row = f"{label:<30}" + "".join(f"{_fmt(v, digits):>{width}}" for v in values)
        if ratio:
            a, b = values
            row += f"{_fmt(b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None):>9}"
        lines.append(row)
    differs = workload_differences(data)
    if differs:
        lines.append(f"WARNING: the workloads differ in {', '.join(differs)}: the columns do not measure the same run")
    else:
        w = data[0]
        random = w.get("random_dataset")  # its output_len is each request's max_tokens
        lengths = (f"random {random.get('input_len')} in / {random.get('output_len')} out" if random
                   else f"max_tokens {w.get('sampling', {}).get('max_tokens')}")
        lines.append(f"same workload: {w.get('dataset')}, {w.get('num_prompts')} prompts, {lengths}, concurrency "
                     f"{w.get('max_concurrency') or 'unbounded'}, rate {w.get('request_rate')}, chat {w.get('chat')}")
    return "\n".join(lines)
