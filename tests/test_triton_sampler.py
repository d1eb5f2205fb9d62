"""The fused Triton sampler (`specdec.triton_verification`) against the torch path.

On a machine with CUDA the tensors live there and the compiled kernel runs. Without one,
conftest sets TRITON_INTERPRET=1 and Triton runs the same kernel on CPU tensors
(numpy-interpreted), so these tests check its logic; its speed is `specdec bench sampler
--device cuda`'s business. The torch path is the one the statistical tests of every
sampling mode prove lossless (tests/test_sampling_modes.py), so the main check is that the
kernel emits the same tokens for the same draws, over ragged, mixed-method batches. (Equal
up to float64 summation order: a draw within ~1e-16 of a cdf boundary could differ, about
V * 2^-52 per draw, never seen with these seeds.)
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

from client.launcher import start_service
from specdec import triton_verification
from specdec.proposals import SPARSE, ProposalFormat
from specdec.sampling import STREAM_VERIFY, SamplingParams, counter_uniforms
from specdec.verification import resolve_backend, speculative_sample
from tests.conftest import chi_square_pvalue

pytest.importorskip("triton")
METHODS = ["rejection", "greedy", "typical"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(seed: int, b: int, k: int, v: int, closeness: float, dense: bool):
    """A ragged batch: p [B, K + 1, V], drafts [B, K] (-1 past num_draft), q [B, K, V] whose rows
    sum to 1-1.5 (so q_sums matter) or None, num_draft [B] in 0..K, counter-based draws."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
    q_norm = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1) * (1 - closeness) + p[:, :k] * closeness
    drafts = torch.multinomial(q_norm.reshape(-1, v), 1, generator=g).reshape(b, k) if k else \
        torch.empty(b, 0, dtype=torch.long)
    num_draft = torch.randint(0, k + 1, (b,), generator=g)
    drafts = torch.where(torch.arange(k)[None] < num_draft[:, None], drafts, -1)
    q = q_norm * (1 + 0.5 * torch.rand(b, k, 1, generator=g)) if dense else None
    positions = torch.arange(k + 1).expand(b, k + 1).contiguous()
    draws = counter_uniforms(torch.arange(b) + 1000 * seed, STREAM_VERIFY, positions)
    return _on_device(p, drafts, q, num_draft, draws)


def _on_device(*tensors):
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def _both(p, drafts, q, num_draft, draws, methods):
    p, drafts, q, num_draft, draws = _on_device(p, drafts, q, num_draft, draws)
    b = p.shape[0]
    thr, alpha = torch.full((b,), 0.09, device=DEVICE), torch.full((b,), 0.3, device=DEVICE)
    ref = speculative_sample(p, drafts, q, num_draft, draws, methods, thr, alpha, backend="torch")
    out = speculative_sample(p, drafts, q, num_draft, draws, methods, thr, alpha, backend="triton")
    return ref, out


@pytest.mark.parametrize("b,k,v,closeness,dense", [
    (48, 4, 3001, 0.9, True),  # V not a multiple of the block, high acceptance, unnormalized q
    (48, 4, 3001, 0.3, True),  # frequent rejections
    (48, 5, 5000, 0.8, False),  # one-hot q (ids-only / n-gram drafts)
    (16, 0, 700, 0.0, False),  # no drafts: every row draws its bonus token
    (8, 8, 4100, 0.95, True),  # gamma 8, two blocks and a tail
])
def test_kernel_emits_the_torch_paths_tokens_for_mixed_ragged_batches(b, k, v, closeness, dense):
    p, drafts, q, num_draft, draws = _batch(b + k, b, k, v, closeness, dense)
    methods = [METHODS[i % 3] for i in range(b)]
    ref, out = _both(p, drafts, q, num_draft, draws, methods)
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(out.output_token_ids, ref.output_token_ids)
    assert torch.equal(out.num_emitted, ref.num_accepted + 1)
    # The batch exercised what it claims: acceptances, rejections and bonus tokens.
    if k and closeness >= 0.8 and dense:  # (a one-hot q accepts with probability p(x): rarely, at this V)
        assert int((ref.num_accepted == num_draft).sum()) >= b // 4
    if k and closeness <= 0.3:
        assert int((ref.num_accepted < num_draft).sum()) >= b // 4


def test_the_narrow_block_config_emits_the_same_tokens(monkeypatch):
    """Large batches on a GPU run 1024-wide blocks: same tokens as the torch path."""
    monkeypatch.setattr(triton_verification, "launch_config", lambda b, device: triton_verification.NARROW)
    p, drafts, q, num_draft, draws = _batch(5, 24, 4, 3001, 0.7, True)
    ref, out = _both(p, drafts, q, num_draft, draws, [METHODS[i % 3] for i in range(24)])
    assert torch.equal(out.output_token_ids, ref.output_token_ids)


def test_kernel_handles_an_all_greedy_batch_without_draws():
    p, drafts, _, num_draft, _ = _batch(7, 12, 4, 900, 0.9, False)
    drafts = torch.where(drafts >= 0, p[:, :4].argmax(-1), drafts)  # every draft is the argmax
    drafts[::3, 1] = (drafts[::3, 1] + 1) % 900  # ... except the second one of every third row
    ref = speculative_sample(p, drafts, None, num_draft, None, ["greedy"] * 12, backend="torch")
    out = speculative_sample(p, drafts, None, num_draft, None, ["greedy"] * 12, backend="triton")
    assert torch.equal(out.output_token_ids, ref.output_token_ids)
    assert int((ref.num_accepted == num_draft).sum()) > 0 and int((ref.num_accepted < num_draft).sum()) > 0


def test_all_zero_residual_falls_back_to_p_in_both_backends():
    """p = 0.5 r, q = r: every draft is rejected with probability 1/2 and (p - q)+ is all zero
    (possible only for rows that are not normalized, i.e. rounding); the pick then uses p."""
    g = torch.Generator().manual_seed(3)
    r = torch.softmax(torch.randn(64, 2, 50, generator=g), -1)
    p = 0.5 * r
    drafts = torch.multinomial(r[:, 0], 1, generator=g)  # [64, 1]
    draws = counter_uniforms(torch.arange(64), STREAM_VERIFY, torch.arange(2).expand(64, 2).contiguous())
    ref, out = _both(p, drafts, r[:, :1], torch.ones(64, dtype=torch.long), draws, ["rejection"] * 64)
    assert torch.equal(out.output_token_ids, ref.output_token_ids)
    rejected = ref.num_accepted == 0
    assert 10 < int(rejected.sum()) < 54
    assert bool((ref.output_token_ids[rejected, 0] >= 0).all())


def test_a_draw_just_below_one_picks_the_last_token_with_mass():
    """Never a massless tail token. (The kernel sums in blocks, torch sequentially: when its cdf
    ends a hair below u * total, the kernel falls back to the last token with mass, which is
    the torch path's pick there too.)"""
    p = torch.zeros(3, 1, 5000)
    p[:, 0, [10, 2500, 4200]] = torch.tensor([0.2, 0.3, 0.5])  # the tail past 4200 has no mass
    draws = torch.full((3, 1, 2), 1.0 - 2.0 ** -53, dtype=torch.float64)
    ref, out = _both(p, torch.empty(3, 0, dtype=torch.long), None, torch.zeros(3, dtype=torch.long), draws,
                     ["rejection"] * 3)
    assert out.output_token_ids[:, 0].tolist() == [4200] * 3 == ref.output_token_ids[:, 0].tolist()
    assert out.num_accepted.tolist() == [0] * 3


def _first_token_counts(q_sums_scale: float, n: int, backend: str) -> tuple[collections.Counter, torch.Tensor]:
    """n requests with gamma 2 drafted from q (rows summing to 1.3); their first emitted token."""
    v, k = 12, 2
    g = torch.Generator().manual_seed(11)
    p_row = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    q_row = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    drafts = torch.multinomial(q_row, n, replacement=True, generator=g).T.contiguous()  # [n, K]
    draws = torch.rand(n, k + 1, 2, generator=g, dtype=torch.float64)
    q = (q_row * 1.3).expand(n, k, v)
    q_sums = torch.full((n, k), 1.3 * q_sums_scale)
    out = speculative_sample(*_on_device(p_row.expand(n, k + 1, v), drafts, q, torch.full((n,), k), draws),
                             ["rejection"] * n, q_sums=q_sums.to(DEVICE), backend=backend)
    return collections.Counter(out.output_token_ids[:, 0].tolist()), p_row[0]


# The interpreter runs a program in ~7 ms, so on CPU the kernel draws 3,000 samples (~20 s); the
# chi-square below has power there (the wrong variant scores p ~ 1e-6 at 3,000, 1e-26 at 20,000).
N_KERNEL = 20_000 if DEVICE.type == "cuda" else 3_000


def test_kernel_first_tokens_follow_the_target_distribution():
    """H0: the first emitted token ~ p_0, with gamma 2 drafts from a different q. N_KERNEL
    requests, V = 12 cells, chi-square, fixed seed, p > 0.001 to pass. Power: the same sampler
    told the wrong row sums of q (so it accepts and resamples against 1.3 q instead of q) is
    rejected on samples of the same size (through the torch backend on CPU, which emits the
    kernel's tokens for the same draws, as the tests above check)."""
    counts, p0 = _first_token_counts(1.0, N_KERNEL, "triton")
    expected = dict(enumerate(p0.tolist()))
    assert chi_square_pvalue(counts, expected, N_KERNEL) > 1e-3
    wrong, _ = _first_token_counts(1 / 1.3, N_KERNEL, "triton" if DEVICE.type == "cuda" else "torch")
    assert chi_square_pvalue(wrong, expected, N_KERNEL) < 1e-3


def test_warm_up_launches_every_variant():
    """Dense and one-hot q, each with rejection-only, greedy (argmax) and typical (argmax and
    mask) rows, for KPAD 1, 2, 4, 8 (up to 8 drafts): 24 launches (compiles on a GPU, where
    tests/test_gpu.py checks no later batch compiles another; interpreted here)."""
    assert triton_verification.warm_up(300, 8, DEVICE) == 24
    assert triton_verification.warm_up(300, 5, DEVICE) == 24  # KPAD 8 covers 5 drafts


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu)


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_verification.available()
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [None, ProposalFormat(kind=SPARSE, top_n=16)], ids=["dense", "sparse-top16"])
def test_a_verifier_on_the_kernel_emits_the_default_verifiers_seeded_tokens(verifier_proc, int8_drafter_proc, fmt):
    """Over gRPC, with the low-acceptance int8 drafter (so rejections happen): a verifier started
    with --sampler-backend triton (interpreted on CPU) emits, for seeded requests of each
    acceptance method, the tokens of the default (torch) verifier, round for round."""
    from client.speculative import SpeculativeClient

    cases = [SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=6, max_tokens=20, ignore_eos=True, acceptance_method="typical"),
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    args = ["--sampler-backend", "triton", "--max-draft-tokens", "8", "--log-level", "WARNING"]
    with start_service("verifier", args, threads=1) as verifier, \
            SpeculativeClient(verifier_proc.address, drafter=int8_drafter_proc.address, proposal_format=fmt) as ref, \
            SpeculativeClient(verifier.address, drafter=int8_drafter_proc.address, proposal_format=fmt) as kernel:
        rejected = 0
        for params in cases:
            want = ref.generate("The history of the printing press", params, num_speculative_tokens=4)
            got = kernel.generate("The history of the printing press", params, num_speculative_tokens=4)
            assert got.token_ids == want.token_ids
            assert got.num_accepted_tokens == want.num_accepted_tokens
            rejected += want.num_draft_tokens - want.num_accepted_tokens
        assert rejected > 0


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="with CUDA the kernel is available")
def test_a_verifier_asked_for_the_kernel_without_cuda_refuses_to_start():
    with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
        start_service("verifier", ["--sampler-backend", "triton", "--log-level", "WARNING"], threads=1,
                      env={"TRITON_INTERPRET": "0"})


def test_bench_sampler_prints_ours_beside_plain_torch(tmp_path):
    """On CPU: the torch backend against the plain-torch loop, in the same run; the kernel and
    FlashInfer columns say they need CUDA."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bench.sampler", "--device", "cpu", "--batch-sizes", "1,8",
                          "--vocab-sizes", "4096", "--repeat", "2", "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, check=True, timeout=300)
    assert "sparse top-16 float16" in out.stdout and "n/a (CUDA+triton)" in out.stdout
    rows = json.loads((tmp_path / "s.json").read_text())["sampler"]
    assert [r["batch_size"] for r in rows] == [1, 8]
    for r in rows:
        assert r["rejection_dense_q_us"] > 0 and r["plain_torch_us"] > 0
        assert r["triton_dense_q_us"] is None and r["triton_with_draws_us"] is None
        assert r["plain_over_ours"] == pytest.approx(r["plain_torch_us"] / r["rejection_dense_q_us"], abs=0.006)


@pytest.mark.parametrize("arch", [80, 90])
def test_kernel_compiles_to_a_cubin_for_a100_and_h100(arch):
    """The compiled path, not just the interpreter: every flag combination and block config lowers through
    Triton's GPU pipeline to ptxas and a cubin for sm_80 / sm_90, which needs no GPU. (In a
    subprocess: Triton builds its own library functions for the interpreter when
    TRITON_INTERPRET is set at its import, and then cannot compile.)"""
    import subprocess
    import sys

    code = f"""
import itertools, re
from specdec import triton_verification as tv
for *flags, config in itertools.product([False, True], [False, True], [False, True], [tv.WIDE, tv.NARROW]):
    c = tv.compile_for({arch}, *flags, config=config)
    ptx = c.asm["ptx"]
    assert c.asm["cubin"] and ".target sm_{arch}" in ptx, flags
    # the residual's q / sum(q) rounds as torch's division does
    assert ("div.rn.f32" in ptx) == flags[0] and "div.full.f32" not in ptx, flags
    print("ok", flags, len(c.asm["cubin"]))
for kpad in (1, 16):  # gamma 1 and up to 16 drafts
    assert tv.compile_for({arch}, True, True, True, kpad=kpad).asm["cubin"]
    print("ok kpad", kpad)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 18
