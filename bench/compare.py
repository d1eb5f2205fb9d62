"""`specdec bench compare`: one workload, several client configurations, one run.

Each variant is `target-only` or `gamma=G[,fanout=F]` with G an integer or `auto`
(adaptive γ); they run one after another against the same services, in the order given,
and every speculative variant is compared with the target-only one of the same run
(measured speedup, ideal speedup from its own α, γ and costs, system efficiency), plus
the share of its drafts that the speculation cache had ready. This is how the closing
notes compare the speculation cache on / off and adaptive against fixed γ.

Rows a few percent apart are within one run's noise on a busy machine, so `--repeats R`
runs the whole list R times, rotating its order each time (a variant is not always the
one that runs first, or right after the same neighbour), compares each repeat with its
own target-only, and reports per variant its median repeat (by speedup) and the range of
its speedups.
"""

from __future__ import annotations

from datetime import datetime, timezone

from bench.serve import WorkloadConfig, _call_timeout, _fmt, add_efficiency, prime_prompts, run_serve
from client.speculative import AUTO, SpeculativeClient

TARGET_ONLY = "target-only"


def parse_variant(text: str) -> dict:
    """'target-only' | 'gamma=4' | 'gamma=auto,fanout=2' -> WorkloadConfig changes."""
    text = text.strip()
    if text == TARGET_ONLY:
        return {"target_only": True}
    changes: dict = {"target_only": False}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = {"g": "gamma", "f": "fanout"}.get(key.strip(), key.strip())
        if not sep or key not in ("gamma", "fanout"):
            raise ValueError(f"a variant is 'target-only' or 'gamma=G[,fanout=F]', got {text!r}")
        value = value.strip()
        if key == "gamma" and value == AUTO:
            changes["num_speculative_tokens"] = AUTO
            continue
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"variant {text!r}: {key} must be an integer{' or auto' if key == 'gamma' else ''}") from None
        if number < (1 if key == "gamma" else 0):
            raise ValueError(f"variant {text!r}: {key} must be >= {1 if key == 'gamma' else 0}")
        changes["num_speculative_tokens" if key == "gamma" else "fanout"] = number
    if "num_speculative_tokens" not in changes:
        raise ValueError(f"variant {text!r} names no gamma")
    return changes


def run_compare(base: WorkloadConfig, variants: list[str], repeats: int = 1) -> dict:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    parsed = [(v, parse_variant(v)) for v in variants]
    if not any(c["target_only"] for _, c in parsed):
        parsed.insert(0, (TARGET_ONLY, {"target_only": True}))  # the baseline is always measured
    runs: dict[str, list[dict]] = {name: [] for name, _ in parsed}
    with SpeculativeClient(base.verifier, drafter=base.drafter, timeout_s=_call_timeout(base),
                           recovery_timeout_s=_call_timeout(base), decode_steps=base.decode_steps,
                           batch_verify=True,  # as serve and sweep send their steps (and the gateway)
                           **base.client_security()) as client:
        primed = prime_prompts(client, base)  # no variant meets a prompt length first
        for rep in range(repeats):
            shift = rep % len(parsed)
            this = {name: run_serve(base.replace(**changes), client)
                    for name, changes in parsed[shift:] + parsed[:shift]}
            baseline = next(r for r in this.values() if r["mode"] == "target-only")
            for name, result in this.items():
                if result["mode"] != "target-only":
                    add_efficiency(result, baseline)
                runs[name].append(result)
    rows = [(name, _median_repeat(runs[name])) for name, _ in parsed]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": "specdec",
        "verifier": base.verifier,
        "drafter": base.drafter,
        "dataset": base.dataset,
        "num_prompts": base.num_prompts,
        "repeats": repeats,
        "primed": primed,
        "variants": [{"variant": name, **result} for name, result in rows],
    }


def _median_repeat(results: list[dict]) -> dict:
    """The repeat with the median speedup (tokens/s per request for target-only), plus every
    repeat's speedup, so a table row is one consistent run and its spread is visible."""
    key = "output_tokens_per_request_s" if results[0]["mode"] == "target-only" else "measured_speedup"
    ranked = sorted(results, key=lambda r: r.get(key) or 0.0)
    row = dict(ranked[(len(ranked) - 1) // 2])
    if len(results) > 1:
        row["repeat_speedups"] = [r.get("measured_speedup") for r in results]
    return row


def format_compare(result: dict) -> str:
    header = (f"{'variant':<22}{'done':>5}{'tok/s/req':>10}{'out tok/s':>10}{'med TTFT':>10}{'med TPOT':>10}"
              f"{'accept':>8}{'drafts/rd':>10}{'cache':>7}{'speedup':>9}{'ideal':>7}{'effic.':>8}")
    lines = [header, "-" * len(header)]
    for r in result["variants"]:
        lines.append(
            f"{r['variant']:<22}{r['completed']:>5}{_fmt(r.get('output_tokens_per_request_s')):>10}"
            f"{_fmt(r['output_throughput']):>10}{_fmt(r['median_ttft_ms'], 1):>10}{_fmt(r['median_tpot_ms'], 1):>10}"
            f"{_fmt(r['acceptance_rate'], 3):>8}{_fmt(r.get('mean_drafts_per_round')):>10}"
            f"{_fmt(r.get('speculation_cache_hit_rate') if r.get('fanout') else None):>7}"
            f"{_fmt(r.get('measured_speedup')):>9}{_fmt(r.get('ideal_speedup')):>7}"
            f"{_fmt(r.get('system_efficiency'), 3):>8}"
            + (f"  (speedups {min(speedups):.2f}-{max(speedups):.2f})"
               if (speedups := [x for x in r.get("repeat_speedups", []) if x is not None]) else "")
        )
    lines.append("tok/s/req: output tokens per second of a request's own life (the speedup basis); "
                 "cache: share of drafts the speculation cache had ready")
    if result.get("repeats", 1) > 1:
        lines.append(f"{result['repeats']} repeats in rotated order: each row is the repeat with the median speedup "
                     "(against the target-only of the same repeat)")
    return "\n".join(lines)
