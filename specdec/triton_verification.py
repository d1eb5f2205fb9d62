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

Triton is optional: `available()` says whether it imports, and the kernel is built on
first use. With TRITON_INTERPRET=1 set before that first use, the same kernel runs on CPU
tensors (numpy-interpreted), which is how the test suite checks it without a GPU.
"""

from __future__ import annotations

import functools
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


@functools.cache
def _kernel(interpret: bool):
    """The kernel, compiled (JITFunction) or numpy-interpreted, whatever TRITON_INTERPRET says now."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def chain_verify_kernel(
        target_ptr,  # [B, K + 1, V] float32, processed target distribution p
        draft_ids_ptr,  # [B, K] int64, -1 past num_draft
        draft_probs_ptr,  # [B, K, V] float32 proposal q (read only if HAS_Q)
        q_sums_ptr,  # [B, K] float32 row sums of q (read only if HAS_Q)
        num_draft_ptr,  # [B] int64
        draws_ptr,  # [B, K + 1, 2] float64 uniforms: acceptance, token pick
        method_ptr,  # [B] int32, METHOD_CODES
        argmax_ptr,  # [B, K + 1] int64 argmax of p (read only if HAS_ARGMAX)
        typical_ptr,  # [B, K] int8 typical accept mask (read only if HAS_TYPICAL)
        out_ptr,  # [B, K + 1] int64 out: accepted drafts, final token, -1 padding
        num_accepted_ptr,  # [B] int64 out
        K,
        V,
        HAS_Q: tl.constexpr,
        HAS_ARGMAX: tl.constexpr,
        HAS_TYPICAL: tl.constexpr,
        KPAD: tl.constexpr,  # next power of two >= max(K, 1)
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        method = tl.load(method_ptr + b)
        nd = tl.load(num_draft_ptr + b)
        # Every draft's accept test at once ([KPAD] lanes, past K masked): one round of gathers
        # instead of K dependent ones.
        js = tl.arange(0, KPAD).to(tl.int64)
        in_k = js < K
        x = tl.load(draft_ids_ptr + b * K + js, mask=in_k, other=0)
        xs = tl.maximum(x, 0)
        p_x = tl.load(target_ptr + (b * (K + 1) + js) * V + xs, mask=in_k, other=0.0)
        u = tl.load(draws_ptr + (b * (K + 1) + js) * 2, mask=in_k, other=1.0)
        if HAS_Q:
            q_x = tl.math.div_rn(tl.load(draft_probs_ptr + (b * K + js) * V + xs, mask=in_k, other=1.0),
                                 tl.load(q_sums_ptr + b * K + js, mask=in_k, other=1.0))
        else:
            q_x = tl.full([KPAD], 1.0, dtype=tl.float32)
        ok = (u * q_x.to(tl.float64)) < p_x.to(tl.float64)
        if HAS_ARGMAX:
            ok = tl.where(method == 0, x == tl.load(argmax_ptr + b * (K + 1) + js, mask=in_k, other=-2), ok)
        if HAS_TYPICAL:
            ok = tl.where(method == 2, tl.load(typical_ptr + b * K + js, mask=in_k, other=0) != 0, ok)
        # n = num_accepted: the first draft j < num_draft that fails its test, else num_draft.
        n = tl.min(tl.where(js < nd, tl.where(ok, nd, js), nd), axis=0)

        rejected = n < nd
        final = n * 0
        if HAS_ARGMAX:
            final = tl.load(argmax_ptr + b * (K + 1) + n)
        need_sample = (method == 1) | ((method == 2) & (rejected == 0))
        if need_sample:
            use_residual = (method == 1) & rejected
            jq = tl.minimum(n, K - 1)  # the rejected draft's row; unused at the bonus position
            # K == 0: jq = -1 and nothing of q or the drafts is read (the drafts tensor is empty).
            x_n = tl.maximum(tl.load(draft_ids_ptr + b * K + tl.maximum(jq, 0), mask=jq >= 0, other=0), 0)
            row_p = target_ptr + (b * (K + 1) + n) * V
            row_q = draft_probs_ptr + (b * K + jq) * V
            q_sum = 1.0
            if HAS_Q:
                q_sum = tl.load(q_sums_ptr + b * K + tl.maximum(jq, 0), mask=jq >= 0, other=1.0)
            # Pass 1: totals of the residual and of p (the fallback when the residual is all zero,
            # i.e. p == q there, where a rejection has probability 0), and the last token with
            # mass of each (the pick if the blocked cdf ends a hair below u * total: the float64
            # sums here and in pass 2 add in different orders).
            total_r = tl.zeros([BLOCK], dtype=tl.float64)
            total_p = tl.zeros([BLOCK], dtype=tl.float64)
            last_r = tl.full([BLOCK], -1, dtype=tl.int64)
            last_p = tl.full([BLOCK], -1, dtype=tl.int64)
            # (q loads are masked with tl.where(flag, m, False): the interpreter turns a block & a
            # scalar into int32, which it refuses as a mask)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK).to(tl.int64)
                m = offs < V
                p = tl.load(row_p + offs, mask=m, other=0.0)
                if HAS_Q:
                    q = tl.load(row_q + offs, mask=tl.where(use_residual, m, False), other=0.0)
                    r = tl.maximum(p - tl.math.div_rn(q, q_sum), 0.0)
                else:
                    r = tl.where(offs == x_n, 0.0, p)
                total_r += r.to(tl.float64)
                total_p += p.to(tl.float64)
                last_r = tl.maximum(last_r, tl.where(m & (r > 0), offs, -1))
                last_p = tl.maximum(last_p, tl.where(m & (p > 0), offs, -1))
            use_residual = use_residual & (tl.sum(total_r, axis=0) > 0)
            total = tl.where(use_residual, tl.sum(total_r, axis=0), tl.sum(total_p, axis=0))
            last = tl.where(use_residual, tl.max(last_r, axis=0), tl.max(last_p, axis=0))
            threshold = tl.load(draws_ptr + (b * (K + 1) + n) * 2 + 1) * total
            # Pass 2: the first token whose cdf passes the threshold; stops at the block holding it.
            found = V + n * 0
            running = total * 0.0
            start = n * 0
            while (start < V) & (found == V):
                offs = start + tl.arange(0, BLOCK).to(tl.int64)
                m = offs < V
                p = tl.load(row_p + offs, mask=m, other=0.0)
                if HAS_Q:
                    q = tl.load(row_q + offs, mask=tl.where(use_residual, m, False), other=0.0)
                    r = tl.maximum(p - tl.math.div_rn(q, q_sum), 0.0)
                else:
                    r = tl.where(offs == x_n, 0.0, p)
                d = tl.where(use_residual, r, p).to(tl.float64)
                cdf = running + tl.cumsum(d, axis=0)
                found = tl.minimum(found, tl.min(tl.where(m & (cdf > threshold), offs, V), axis=0))
                running += tl.sum(d, axis=0)
                start += BLOCK
            final = tl.where(found < V, found, last)

        cols = tl.arange(0, 16).to(tl.int64)
        for c0 in range(0, K + 1, 16):
            c = c0 + cols
            d = tl.load(draft_ids_ptr + b * K + c, mask=c < K, other=-1)
            row = tl.where(c < n, d, -1)
            row = tl.where(c == n, final, row)
            tl.store(out_ptr + b * (K + 1) + c, row, mask=c < K + 1)
        tl.store(num_accepted_ptr + b, n)

    return InterpretedFunction(chain_verify_kernel) if interpret else JITFunction(chain_verify_kernel)


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

    pointers = ["*fp32", "*i64", "*fp32", "*fp32", "*i64", "*fp64", "*i32", "*i64", "*i8", "*i64", "*i64"]
    kernel = _kernel(False)
    names = kernel.arg_names
    signature = dict(zip(names, pointers + ["i32", "i32"] + ["constexpr"] * 5))
    constexprs = {"HAS_Q": has_q, "HAS_ARGMAX": has_argmax, "HAS_TYPICAL": has_typical, "KPAD": kpad,
                  "BLOCK": config[0]}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": config[1], **FP_OPTIONS})


def warm_up(vocab_size: int, max_draft_tokens: int, device: torch.device) -> int:
    """Compile (or load from Triton's on-disk cache) the variants a verifier meets first, so no
    request waits seconds for a compile: dense q, one-hot q and all-greedy batches, for every
    KPAD up to max_draft_tokens' (the vocabulary's own size, so its divisibility hints match).
    Returns the number of variants launched."""
    variants = 0
    kpad = 1
    while True:
        k = kpad
        p = torch.full((1, k + 1, vocab_size), 1.0 / vocab_size, device=device)
        drafts = torch.zeros(1, k, dtype=torch.int64, device=device)
        num_draft = torch.full((1,), k, dtype=torch.int64, device=device)
        draws = torch.full((1, k + 1, 2), 0.5, dtype=torch.float64, device=device)
        rejection = torch.full((1,), METHOD_CODES["rejection"], dtype=torch.int32, device=device)
        greedy = torch.full((1,), METHOD_CODES["greedy"], dtype=torch.int32, device=device)
        q = p[:, :k].contiguous()
        chain_verify(p, drafts, q, q.sum(dim=-1), num_draft, draws, rejection, None, None)
        chain_verify(p, drafts, None, None, num_draft, draws, rejection, None, None)
        chain_verify(p, drafts, None, None, num_draft, draws, greedy, p.argmax(dim=-1), None)
        variants += 3
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

    b, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    out = torch.empty(b, k1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return out, num_accepted
    dummy_f = target_probs  # any tensor: a constexpr flag keeps the kernel from reading it
    block, num_warps = launch_config(b, dev)
    _kernel(interpreting())[(b,)](
        target_probs.contiguous(),
        draft_token_ids.to(torch.int64).contiguous(),
        dummy_f if draft_probs is None else draft_probs.to(torch.float32).contiguous(),
        dummy_f if q_sums is None else q_sums.to(torch.float32).contiguous(),
        num_draft.to(torch.int64).contiguous(),
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
