"""`specdec bench sweep`: `serve` at several concurrencies or request rates, each point
run speculative and target-only back to back (so every point has its own baseline and
system efficiency), one JSON with all points, one table (plus both modes of each point per
category), one PNG."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Sequence

from bench.serve import WorkloadConfig, _call_timeout, _fmt, _json_rate, add_efficiency, run_serve
from client.speculative import SpeculativeClient


def parse_points(text: str, flag: str, integer: bool) -> list[float]:
    """'1,2,4' -> [1, 2, 4]: positive integers, or positive numbers including inf."""
    values: list[float] = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        try:
            value = int(item) if integer else float(item)
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated {'integers' if integer else 'numbers or inf'}, "
                             f"got {item!r}") from None
        if not value > 0:
            raise ValueError(f"{flag} values must be > 0, got {item!r}")
        values.append(value)
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def run_sweep(base: WorkloadConfig, concurrency: Sequence[int] = (), request_rates: Sequence[float] = ()) -> dict:
    """One point per concurrency (at base.request_rate) or per request rate (at
    base.max_concurrency)."""
    if bool(concurrency) == bool(request_rates):
        raise ValueError("give exactly one of --concurrency and --request-rates")
    if concurrency:
        settings = [({"max_concurrency": c}, f"c={c}") for c in concurrency]
    else:
        settings = [({"request_rate": r}, f"rate={'inf' if math.isinf(r) else f'{r:g}'}") for r in request_rates]
    from tqdm import tqdm

    points = []
    with SpeculativeClient(base.verifier, drafter=base.drafter, num_speculative_tokens=base.num_speculative_tokens,
                           timeout_s=_call_timeout(base),
                           recovery_timeout_s=_call_timeout(base)) as client:
        bar = tqdm(total=2 * len(settings), desc="sweep", unit="run", disable=not base.show_progress)
        for changes, label in settings:
            bar.set_postfix_str(label)
            spec = run_serve(base.replace(target_only=False, **changes), client)
            bar.update(1)
            target = run_serve(base.replace(target_only=True, **changes), client)
            bar.update(1)
            add_efficiency(spec, target)
            points.append({"label": label, **{k: _json_rate(v) if k == "request_rate" else v
                                              for k, v in changes.items()},
                           "speculative": spec, "target_only": target,
                           "ideal_speedup": spec["ideal_speedup"], "measured_speedup": spec["measured_speedup"],
                           "system_efficiency": spec["system_efficiency"]})
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
    for p in sweep["points"]:
        lines += ["", format_point_categories(p)]
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
