"""`specdec bench sampler`: cost of the batched verification sampler and of each proposal form.

Prints, for one device (cpu, or cuda when available):
  * microseconds per `speculative_sample` call at several batch sizes, for rejection
    sampling with dense q on the torch backend and (CUDA) on the fused Triton kernel, with
    one-hot q (ids-only / n-gram drafts), greedy matching and typical acceptance (each on
    the backend "auto" picks), plus the seeded draws (`counter_uniforms`) on their own;
  * the bytes a proposal puts on the wire per round for each form (V, gamma as given).
A plain-torch reference (the textbook loop: per position an accept test, a residual and
a `torch.multinomial`, with host syncs) is timed in the same run, and FlashInfer's
`chain_speculative_sampling` beside both when it is importable (it needs CUDA);
otherwise its column says so. Default shapes: B in {1, 16, 64}, V 49152, γ 4 on CPU; the
issue's anchor shapes on CUDA (B in {1, 64, 256}, V in {32000, 151936}, γ in {4, 8}).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from specdec import triton_verification
from specdec.argtypes import device as device_arg, output_file, positive, positive_list
from specdec.proposals import DENSE, IDS_ONLY, SPARSE, ProposalBuilder, ProposalFormat
from specdec.sampling import STREAM_VERIFY, counter_uniforms
from specdec.verification import speculative_sample

PROPOSAL_FORMS = [
    ("dense float32", ProposalFormat(kind=DENSE, dtype="float32")),
    ("dense float16", ProposalFormat(kind=DENSE, dtype="float16")),
    ("dense bfloat16", ProposalFormat(kind=DENSE, dtype="bfloat16")),
    ("sparse top-64 float32", ProposalFormat(kind=SPARSE, dtype="float32", top_n=64)),
    ("sparse top-64 float16", ProposalFormat(kind=SPARSE, dtype="float16", top_n=64)),
    ("sparse top-16 float16", ProposalFormat(kind=SPARSE, dtype="float16", top_n=16)),
    ("ids-only", ProposalFormat(kind=IDS_ONLY)),
]


def proposal_bytes(vocab: int, gamma: int, seed: int = 0) -> list[tuple[str, int]]:
    """(form, payload bytes per round): probabilities + sparse ids, plus 4 bytes per draft id."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 3, dim=-1)
    out = []
    for name, fmt in PROPOSAL_FORMS:
        builder = ProposalBuilder(fmt, vocab)
        for j in range(gamma):
            builder.sample(probs[j], float(torch.rand(1, generator=gen)), int(probs[j].argmax()))
        out.append((name, builder.build().nbytes + 4 * gamma))
    return out


def _time_us(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e6


def _flashinfer() -> Callable | None:
    try:
        from flashinfer.sampling import chain_speculative_sampling  # type: ignore[import-not-found]
    except Exception:  # not installed, or no CUDA build
        return None
    return chain_speculative_sampling


def plain_torch_reference(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Textbook chain speculative sampling, position by position. p: [B, K + 1, V], q: [B, K, V]."""
    b, k = drafts.shape
    out = torch.full((b, k + 1), -1, dtype=torch.long, device=p.device)
    alive = torch.ones(b, dtype=torch.bool, device=p.device)
    for j in range(k):
        x = drafts[:, j]
        ratio = p[:, j].gather(1, x[:, None])[:, 0] / q[:, j].gather(1, x[:, None])[:, 0]
        accept = torch.rand(b, generator=gen, device=p.device) < ratio.clamp(max=1.0)
        rejected = alive & ~accept
        if bool(rejected.any()):
            residual = (p[rejected, j] - q[rejected, j]).clamp_min(0.0)
            out[rejected, j] = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
        out[alive & accept, j] = x[alive & accept]
        alive &= accept
    bonus = torch.multinomial(p[:, k], 1, generator=gen)[:, 0]
    out[alive, k] = bonus[alive]
    return out


def sampler_timings(device: torch.device, batch_sizes: list[int], gamma: int, vocab: int,
                    repeat: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    flashinfer = _flashinfer() if device.type == "cuda" else None
    triton = device.type == "cuda" and triton_verification.available()
    rows = []
    for b in batch_sizes:
        p = torch.softmax(torch.randn(b, gamma + 1, vocab, device=device, generator=gen) * 3, -1)
        q = torch.softmax(torch.randn(b, gamma, vocab, device=device, generator=gen) * 3, -1)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(b, gamma)
        q_sums = q.sum(dim=-1)  # [B, gamma]: the verifier has them from decoding the proposal, off this path
        num_draft = torch.full((b,), gamma, device=device)
        seeds = torch.arange(b, device=device, dtype=torch.int64)
        positions = 100 + torch.arange(gamma + 1, device=device, dtype=torch.int64).expand(b, gamma + 1)
        draws = counter_uniforms(seeds, STREAM_VERIFY, positions)  # [B, gamma + 1, 2]
        thr, alpha = torch.full((b,), 0.09, device=device), torch.full((b,), 0.3, device=device)
        row = {"batch_size": b, "gamma": gamma, "vocab": vocab, "device": device.type}
        cases = {
            "rejection_dense_q_us": lambda: speculative_sample(p, drafts, q, num_draft, draws, ["rejection"] * b,
                                                               q_sums=q_sums, backend="torch"),
            "rejection_one_hot_q_us": lambda: speculative_sample(p, drafts, None, num_draft, draws, ["rejection"] * b),
            "greedy_us": lambda: speculative_sample(p, drafts, None, num_draft, None, ["greedy"] * b),
            "typical_us": lambda: speculative_sample(p, drafts, None, num_draft, draws, ["typical"] * b, thr, alpha),
            # The seeded draws of the whole batch: counter-based, on the device, no host sync.
            "seeded_draws_us": lambda: counter_uniforms(seeds, STREAM_VERIFY, positions),
            "plain_torch_us": lambda: plain_torch_reference(p, drafts, q, gen),
        }
        if triton:
            cases["triton_dense_q_us"] = lambda: speculative_sample(p, drafts, q, num_draft, draws, ["rejection"] * b,
                                                                    q_sums=q_sums, backend="triton")
            # FlashInfer draws its uniforms inside its kernel: the fair comparison includes ours.
            cases["triton_with_draws_us"] = lambda: speculative_sample(
                p, drafts, q, num_draft, counter_uniforms(seeds, STREAM_VERIFY, positions), ["rejection"] * b,
                q_sums=q_sums, backend="triton")
        for name, fn in cases.items():
            row[name] = round(_time_us(fn, device, repeat), 1)
        row.setdefault("triton_dense_q_us", None)
        row.setdefault("triton_with_draws_us", None)
        if flashinfer is not None:
            ids32 = drafts.to(torch.int32)
            row["flashinfer_chain_us"] = round(_time_us(lambda: flashinfer(q, ids32, p), device, repeat), 1)
        else:
            row["flashinfer_chain_us"] = None
        rows.append(row)
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device_arg(auto=True), default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--batch-sizes", type=positive_list("--batch-sizes"), default=None,
                   help="comma-separated (default: 1,16,64 on CPU, 1,64,256 on CUDA)")
    p.add_argument("--gammas", type=positive_list("--gammas"), default=None,
                   help="comma-separated (default: 4 on CPU, 4,8 on CUDA)")
    p.add_argument("--vocab-sizes", type=positive_list("--vocab-sizes"), default=None,
                   help="comma-separated (default: 49152 on CPU, 32000,151936 on CUDA)")
    p.add_argument("--repeat", type=positive("--repeat"), default=20)
    p.add_argument("--json", type=output_file, default=None, help="also write the results to this path")


def run(args: argparse.Namespace) -> int:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    batch_sizes = args.batch_sizes or ([1, 64, 256] if cuda else [1, 16, 64])
    vocabs = args.vocab_sizes or ([32000, 151936] if cuda else [49152])
    gammas = args.gammas or ([4, 8] if cuda else [4])
    sizes = proposal_bytes(vocabs[-1], gammas[0])
    print(f"proposal bytes per round (V={vocabs[-1]}, gamma={gammas[0]}):")
    dense = sizes[0][1]
    for name, n in sizes:
        print(f"  {name:<24} {n:>9,d} B   ({dense / n:,.0f}x smaller than dense float32)")
    rows = []
    for vocab in vocabs:
        for gamma in gammas:
            rows += sampler_timings(device, batch_sizes, gamma, vocab, args.repeat)
    keys = [k for k in rows[0] if k.endswith("_us")]
    missing = {"triton_dense_q_us": "n/a (CUDA+triton)", "triton_with_draws_us": "n/a (CUDA+triton)",
               "flashinfer_chain_us": "n/a (no flashinfer)"}
    print(f"\nsampler, microseconds per call on {device} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads). Last columns: the plain-torch loop's time over our fastest dense-q "
          f"rejection sampler's, and FlashInfer's over the Triton kernel's plus its draws (> 1: ours is faster):")
    print(f"  {'V':>7} {'γ':>2} {'B':>4} " + " ".join(f"{k[:-3]:>20}" for k in keys)
          + f" {'plain/ours':>11} {'flashinfer/triton':>18}")
    for r in rows:
        cells = [missing.get(k, "n/a") if r[k] is None else f"{r[k]:,.1f}" for k in keys]
        ours = min(t for t in (r["rejection_dense_q_us"], r["triton_dense_q_us"]) if t is not None)
        r["plain_over_ours"] = round(r["plain_torch_us"] / ours, 2)
        r["flashinfer_over_triton"] = None
        if r["flashinfer_chain_us"] is not None and r["triton_with_draws_us"] is not None:
            r["flashinfer_over_triton"] = round(r["flashinfer_chain_us"] / r["triton_with_draws_us"], 2)
        vs_fi = "n/a" if r["flashinfer_over_triton"] is None else f"{r['flashinfer_over_triton']:.2f}x"
        print(f"  {r['vocab']:>7} {r['gamma']:>2} {r['batch_size']:>4} " + " ".join(f"{c:>20}" for c in cells)
              + f" {r['plain_over_ours']:>10.1f}x {vs_fi:>18}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"proposal_bytes": dict(sizes), "sampler": rows}, fh, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.sampler ...`: the same as `specdec bench sampler`, without the
    client's imports (grpc), for a GPU machine that has only torch (and triton, flashinfer)."""
    parser = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
