"""Fused Triton kernel for `speculative_sample`: one launch per batch, no host sync.

One program per request walks its drafts (the accept tests), finds the stop position
n = num_accepted, and draws the final token there: from normalize((p_n - q_n)+) after a
rejection, from p_n for the bonus, or argmax p_n for greedy rows and for typical rows at a
rejection. The V-wide work is two streaming passes over one row of p (and q): a pass
that sums the distribution in float64, then a cumulative-sum pass that stops at the first
token whose cdf passes u * total. This is FlashInfer's `chain_speculative_sampling`
structure, with three differences that make the output the torch path's (identical up to
float64 summation order: the kernel sums in blocks, torch sequentially, so a draw within
~1e-16 of a cdf boundary, about V * 2^-52 per draw, could pick the neighbouring token):

  * randomness is the caller's `draws` ([B, K + 1, 2] float64, `counter_uniforms`), so a
    seeded request gives the same tokens whatever its batch mates and whichever backend
    ran (FlashInfer draws from one Philox seed / offset per call);
  * q rows need not be normalized: `q_sums` ([B, K]) divides q as the torch path does;
  * the token pick is the torch path's inverse CDF (`sample_inverse_cdf`): first i with
    cdf[i] > u * total in float64, the last token with mass if rounding leaves none.
The accept test is `u * q(x) < p(x)` (no division by q, no epsilon). q / q_sums uses
`div_rn` (IEEE round-to-nearest, as torch divides; Triton's `/` on float32 is approximate),
so the residual has the torch path's bits. Greedy rows compare
against the target's argmax, and typical rows take their accept mask, from the caller
(`target_argmax`, `typical_accept`), which computes each only when some row needs it.

Triton is optional: `available()` says whether it imports, and the kernel module
(`specdec.triton_kernels`) is imported on first use. With TRITON_INTERPRET=1 set before
triton's first import, the same kernel runs on CPU tensors (numpy-interpreted), which is how
the test suite checks it without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import torch

METHOD_CODES = {"greedy": 0, "rejection": 1, "typical": 2}
# (BLOCK over V, warps) per program. Fewer requests than SMs: each program has an SM to itself, so
# it streams wide blocks (16 warps, 110 registers on sm_90). More: 1024-wide blocks at 82 registers
# fit three programs per SM. Chosen from ptxas resource usage, not yet tuned on a GPU.
WIDE, NARROW = (2048, 16), (1024, 8)
# No fused multiply-adds: every product and sum rounds as torch's separate ops do.
FP_OPTIONS = {"enable_fp_fusion": False}


def available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or a broken install
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_config(batch_size: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK, num_warps) for a batch: WIDE while the batch leaves SMs idle, else NARROW."""
    if device.type != "cuda":
        return WIDE
    return WIDE if batch_size < torch.cuda.get_device_properties(device).multi_processor_count else NARROW


def compile_for(arch: int, has_q: bool, has_argmax: bool, has_typical: bool, config: tuple[int, int] = WIDE,
                kpad: int = 8):
    """Ahead-of-time compile to a cubin for sm_<arch> (Triton ships ptxas; no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from specdec.triton_kernels import chain_verify_kernel as kernel

    pointers = ["*fp32", "*i64", "*fp32", "*fp32", "*i64", "*fp64", "*i32", "*i64", "*i8", "*i64", "*i64"]
    names = kernel.arg_names
    signature = dict(zip(names, pointers + ["i32", "i32"] + ["constexpr"] * 5))
    constexprs = {"HAS_Q": has_q, "HAS_ARGMAX": has_argmax, "HAS_TYPICAL": has_typical, "KPAD": kpad,
                  "BLOCK": config[0]}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": config[1], **FP_OPTIONS})


def warm_up(vocab_size: int, max_draft_tokens: int, device: torch.device) -> int:
    """Compile (or load from Triton's on-disk cache) every variant a verifier can launch, so no
    request waits seconds for a compile: each set of the HAS_* flags a batch can need (dense or
    one-hot q; greedy or typical rows beside sampled ones, which need the argmax; typical rows
    their accept mask) for every KPAD up to max_draft_tokens', at the vocabulary's own size (so
    its divisibility hints match). K itself and num_draft's alignment do not specialize the
    kernel (`chain_verify`), so γ 0, odd γ and one-request batches reuse these. Returns the
    number of variants launched."""
    variants = 0
    kpad = 1
    while True:  # (chain_verify launches under `device`: no current-device guard is needed here)
        k = kpad
        p = torch.full((1, k + 1, vocab_size), 1.0 / vocab_size, device=device)
        drafts = torch.zeros(1, k, dtype=torch.int64, device=device)
        num_draft = torch.full((1,), k, dtype=torch.int64, device=device)
        draws = torch.full((1, k + 1, 2), 0.5, dtype=torch.float64, device=device)
        q = p[:, :k].contiguous()
        argmax, typical = p.argmax(dim=-1), torch.ones(1, k, dtype=torch.bool, device=device)
        for code, with_argmax, with_typical in (("rejection", False, False), ("greedy", True, False),
                                                ("typical", True, True)):
            method = torch.full((1,), METHOD_CODES[code], dtype=torch.int32, device=device)
            for q_, q_sums in ((q, q.sum(dim=-1)), (None, None)):
                chain_verify(p, drafts, q_, q_sums, num_draft, draws, method, argmax if with_argmax else None,
                             typical if with_typical else None)
                variants += 1
        if kpad >= max_draft_tokens:
            return variants
        kpad *= 2


def chain_verify(
    target_probs: torch.Tensor,  # [B, K + 1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, or None: every q one-hot
    q_sums: torch.Tensor | None,  # [B, K] float32 row sums of draft_probs (None with it)
    num_draft: torch.Tensor,  # [B] int64
    draws: torch.Tensor,  # [B, K + 1, 2] float64
    method_codes: torch.Tensor,  # [B] int32, METHOD_CODES
    target_argmax: torch.Tensor | None,  # [B, K + 1] int64, needed if any greedy or typical row
    typical_accept: torch.Tensor | None,  # [B, K] bool, needed if any typical row
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (output_token_ids [B, K + 1] int64 with -1 padding, num_accepted [B] int64)."""
    import triton

    from specdec.triton_kernels import chain_verify_kernel

    b, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    out = torch.empty(b, k1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return out, num_accepted
    dummy_f = target_probs  # any tensor: a constexpr flag keeps the kernel from reading it
    block, num_warps = launch_config(b, dev)
    num_draft = num_draft.to(torch.int64).contiguous()
    if num_draft.data_ptr() % 16:  # a column view of the engine's [B, K + 3] inputs: Triton would
        num_draft = num_draft.clone()  # compile another variant for a pointer not 16-byte aligned
    # Triton launches on the current CUDA device's stream, whatever the tensors' device: make it
    # the model's (cuda:1 too), not the calling thread's default.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        chain_verify_kernel[(b,)](
            target_probs.contiguous(),
            draft_token_ids.to(torch.int64).contiguous(),
            dummy_f if draft_probs is None else draft_probs.to(torch.float32).contiguous(),
            dummy_f if q_sums is None else q_sums.to(torch.float32).contiguous(),
            num_draft,
            draws.to(torch.float64).contiguous(),
            method_codes.to(torch.int32).contiguous(),
            out if target_argmax is None else target_argmax.to(torch.int64).contiguous(),
            out if typical_accept is None else typical_accept.to(torch.int8).contiguous(),
            out,
            num_accepted,
            k,
            v,
            HAS_Q=draft_probs is not None,
            HAS_ARGMAX=target_argmax is not None,
            HAS_TYPICAL=typical_accept is not None,
            KPAD=triton.next_power_of_2(max(k, 1)),
            BLOCK=block,
            num_warps=num_warps,
            **FP_OPTIONS,
        )
    return out, num_accepted
