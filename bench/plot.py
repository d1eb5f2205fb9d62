"""PNG figures of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from typing import Sequence

from bench.serve import accepted_per_round


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _accepted_histogram(ax, counts: Sequence[int], gamma: int | str) -> None:
    fixed = isinstance(gamma, int)
    if counts:
        top = max(gamma if fixed else 0, max(counts))
        ax.hist(counts, bins=[b - 0.5 for b in range(top + 2)], rwidth=0.85, color="tab:blue")
        ax.set_xticks(range(top + 1))
    else:  # (the openai backend gets totals from our gateway, not each round)
        ax.text(0.5, 0.5, "no speculative rounds, or no per-round counts from this server", ha="center",
                va="center", transform=ax.transAxes)
    ax.set_xlabel(f"accepted drafts per round (rounds that drafted {gamma if fixed else 'any'})")
    ax.set_ylabel("rounds")
    ax.set_title(f"Accepted tokens per round (gamma={gamma})")


def plot_sweep(points: Sequence[dict], path: str, latency: str = "tpot") -> None:
    """Output throughput vs median latency (one curve per mode, each point labelled with
    its concurrency / rate), and the histogram of accepted drafts per round."""
    plt = _pyplot()
    fig, (ax, hist) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode, style in (("speculative", "o-"), ("target_only", "s--")):
        xs = [p[mode][f"median_{latency}_ms"] for p in points]
        ys = [p[mode]["output_throughput"] for p in points]
        if any(x is None for x in xs):
            continue
        ax.plot(xs, ys, style, label=mode.replace("_", "-"))
        for x, y, p in zip(xs, ys, points):
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel(f"median {latency.upper()} (ms)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("Throughput vs latency")
    ax.grid(alpha=0.3)
    ax.legend()
    gamma = points[0]["speculative"]["num_speculative_tokens"] if points else 0
    _accepted_histogram(hist, accepted_per_round((p["speculative"] for p in points), gamma), gamma)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve(result: dict, path: str) -> None:
    """One run: the accepted-per-round histogram and the latency CDFs (TTFT, E2EL)."""
    plt = _pyplot()
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(12, 4.8))
    gamma = result["num_speculative_tokens"]
    _accepted_histogram(hist, accepted_per_round([result], gamma), gamma)
    done = [r for r in result["per_request"] if r["error"] is None]
    for key, label in (("ttft", "TTFT"), ("e2el", "E2E latency")):
        values = sorted(r[key] * 1000.0 for r in done)
        if values:
            cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    cdf.set_xlabel("ms")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"Latency CDF ({result['mode']}, {len(done)} requests)")
    cdf.grid(alpha=0.3)
    cdf.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
