"""`specdec bench sweep`: `serve` at several concurrencies or request rates, each point
run speculative and target-only back to back (so every point has its own baseline and
system efficiency), one JSON with all points, one table (plus both modes of each point per
category), one PNG.

Before a point's two modes, each of its prompts is prefilled once (`serve.prime_prompts`), so
neither mode meets a prompt length first; before each measured run an unmeasured wave of
requests at the point's concurrency and max_tokens (`serve.warm_up`), so no measured request
pays a new batch shape's first cost. Per
point, against the engines (see bench/serve.py): host ms beside device ms per round, the
engine-bound tokens/s of each mode and the measured tokens/s against it, the ideal speedup
from the engines' device times and the measured speedup against it."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Sequence

from bench.serve import (
    WorkloadConfig, _call_timeout, _fmt, _json_rate, add_efficiency, prime_prompts, run_serve, warm_up,
)
from client.speculative import SpeculativeClient


def point_efficiency(spec: dict, target: dict) -> dict:
    """A point's figures against the engines, from its two runs' results (pure): the measured
    and ideal speedups (ideal = engine-bound tok/s of speculative / of target-only, from the
    engines' device times), system_efficiency = measured / ideal, and per mode the measured
    tok/s over the engine-bound tok/s (engine_efficiency) and the host and device ms per round."""
    keys = ("mean_verify_device_ms_per_round", "mean_verify_step_ms_per_round", "mean_verify_host_ms_per_round",
            "mean_draft_device_ms_per_round", "engine_tokens_per_request_s", "engine_efficiency")
    spec_tps, target_tps = spec.get("output_tokens_per_request_s"), target.get("output_tokens_per_request_s")
    spec_engine, target_engine = spec.get("engine_tokens_per_request_s"), target.get("engine_tokens_per_request_s")
    measured = spec_tps / target_tps if spec_tps is not None and target_tps else None
    ideal = spec_engine / target_engine if spec_engine and target_engine else None
    return {"measured_speedup": measured, "ideal_speedup": ideal,
            "system_efficiency": measured / ideal if measured is not None and ideal else None,
            "engine": {mode: {k: r.get(k) for k in keys} for mode, r in (("speculative", spec),
                                                                          ("target_only", target))}}


def run_sweep(base: WorkloadConfig, concurrency: Sequence[int] = (), request_rates: Sequence[float] = (),
              warmup: bool = True) -> dict:
    """One point per concurrency (at base.request_rate) or per request rate (at
    base.max_concurrency), each mode after its warm-up wave (`warmup`)."""
    if bool(concurrency) == bool(request_rates):
        raise ValueError("give exactly one of --concurrency and --request-rates")
    if concurrency:
        settings = [({"max_concurrency": c}, f"c={c}") for c in concurrency]
    else:
        settings = [({"request_rate": r}, f"rate={'inf' if math.isinf(r) else f'{r:g}'}") for r in request_rates]
    from tqdm import tqdm

    points = []
    with SpeculativeClient(base.verifier, drafter=base.drafter, num_speculative_tokens=base.num_speculative_tokens,
                           timeout_s=_call_timeout(base), recovery_timeout_s=_call_timeout(base),
                           decode_steps=base.decode_steps,
                           batch_verify=True,  # one VerifyBatch per step, as the gateway sends them
                           **base.client_security()) as client:
        bar = tqdm(total=2 * len(settings), desc="sweep", unit="run", disable=not base.show_progress)
        primed_prompts: set = set()
        for changes, label in settings:
            bar.set_postfix_str(label)
            runs, warmups = {}, {}
            primed = prime_prompts(client, base.replace(**changes), primed_prompts) if warmup else None
            for mode, target_only in (("speculative", False), ("target_only", True)):
                config = base.replace(target_only=target_only, **changes)
                if warmup:
                    warmups[mode] = warm_up(client, config)
                runs[mode] = run_serve(config, client)
                bar.update(1)
            spec, target = runs["speculative"], runs["target_only"]
            add_efficiency(spec, target)
            points.append({"label": label, **{k: _json_rate(v) if k == "request_rate" else v
                                              for k, v in changes.items()},
                           "speculative": spec, "target_only": target, "warmup": warmups, "primed": primed,
                           **point_efficiency(spec, target)})
        bar.close()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": "specdec",
        "sweep": "max_concurrency" if concurrency else "request_rate",
        "verifier": base.verifier,
        "drafter": base.drafter,
        "dataset": base.dataset,
        "num_prompts": base.num_prompts,
        "num_speculative_tokens": base.num_speculative_tokens,
        "points": points,
    }


def format_sweep(sweep: dict) -> str:
    header = (f"{'point':<10}{'mode':<13}{'done':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>10}{'med TTFT':>10}"
              f"{'med TPOT':>10}{'med E2EL':>10}{'accept':>8}{'spec rnd':>9}{'mean γ':>7}{'speedup':>9}{'ideal':>7}"
              f"{'effic.':>8}")
    lines = [header, "-" * len(header)]
    for p in sweep["points"]:
        for mode in ("speculative", "target_only"):
            r = p[mode]
            spec = mode == "speculative"
            lines.append(
                f"{p['label']:<10}{mode.replace('_', '-'):<13}{r['completed']:>5}{r['failed']:>5}"
                f"{_fmt(r['request_throughput']):>8}{_fmt(r['output_throughput']):>10}"
                f"{_fmt(r['median_ttft_ms'], 1):>10}{_fmt(r['median_tpot_ms'], 1):>10}"
                f"{_fmt(r['median_e2el_ms'], 1):>10}{_fmt(r['acceptance_rate'], 3):>8}"
                f"{_fmt(r.get('speculative_round_share') if spec else None):>9}"
                f"{_fmt((r.get('mean_drafts_per_round') or 0.0) if spec else None):>7}"
                f"{_fmt(p['measured_speedup'] if spec else None):>9}{_fmt(p['ideal_speedup'] if spec else None):>7}"
                f"{_fmt(p['system_efficiency'] if spec else None, 3):>8}"
            )
    lines += ["", format_engine_table(sweep["points"])]
    for p in sweep["points"]:
        lines += ["", format_point_categories(p)]
    return "\n".join(lines)


def format_engine_table(points: list[dict]) -> str:
    """Per point and mode: verify host ms beside device ms per round, draft device ms, the
    engine-bound and measured tok/s per request, their ratio; then ideal vs measured speedup."""
    header = (f"{'point':<10}{'mode':<13}{'vfy dev ms':>11}{'vfy step':>9}{'vfy host':>9}{'dft dev':>8}"
              f"{'engine tok/s':>13}{'meas tok/s':>11}{'meas/eng':>9}{'ideal':>7}{'speedup':>9}{'meas/ideal':>11}")
    lines = ["Against the engines (per round; tok/s per request)", header, "-" * len(header)]
    for p in points:
        for mode in ("speculative", "target_only"):
            r, spec = p[mode], mode == "speculative"
            lines.append(
                f"{p['label']:<10}{mode.replace('_', '-'):<13}{_fmt(r.get('mean_verify_device_ms_per_round')):>11}"
                f"{_fmt(r.get('mean_verify_step_ms_per_round')):>9}{_fmt(r.get('mean_verify_host_ms_per_round')):>9}"
                f"{_fmt(r.get('mean_draft_device_ms_per_round')):>8}{_fmt(r.get('engine_tokens_per_request_s'), 1):>13}"
                f"{_fmt(r.get('output_tokens_per_request_s'), 1):>11}{_fmt(r.get('engine_efficiency'), 3):>9}"
                f"{_fmt(p['ideal_speedup'] if spec else None):>7}{_fmt(p['measured_speedup'] if spec else None):>9}"
                f"{_fmt(p['system_efficiency'] if spec else None, 3):>11}")
    return "\n".join(lines)


def format_point_categories(point: dict) -> str:
    """Both modes of one point per category: tokens/s of a request's own life (output
    tokens / summed request latency, the speedup basis), their ratio, and acceptance."""
    spec, target = point["speculative"]["per_category"], point["target_only"]["per_category"]
    header = (f"{point['label'] + ' by category':<22}{'spec tok/s':>11}{'target tok/s':>13}{'speedup':>9}"
              f"{'accept':>8}{'ideal':>7}")
    lines = [header, "-" * len(header)]
    for cat, m in spec.items():
        base = target.get(cat, {})
        lines.append(f"{cat:<22}{_fmt(m['output_tokens_per_request_s']):>11}"
                     f"{_fmt(base.get('output_tokens_per_request_s')):>13}{_fmt(m.get('measured_speedup')):>9}"
                     f"{_fmt(m['acceptance_rate'], 3):>8}{_fmt(m.get('ideal_speedup')):>7}")
    return "\n".join(lines)
