"""The Triton kernel behind `specdec.triton_verification` (which documents it), with its helper.

Imported on first use only, so that `import specdec` needs no triton. Whether `@triton.jit`
gives a compiled or a numpy-interpreted kernel is decided here, at import, by
TRITON_INTERPRET (the test suite sets it before anything imports triton).
"""

import triton
import triton.language as tl


@triton.jit
def residual_block(row_p, row_q, offs, m, use_residual, q_sum, x_n, HAS_Q: tl.constexpr):
    """One block of p and of the residual (p - q / q_sum)+, or p without x_n for a one-hot q."""
    p = tl.load(row_p + offs, mask=m, other=0.0)
    if HAS_Q:
        # (masked with tl.where(flag, m, False): the interpreter turns a block & a scalar into
        # int32, which it refuses as a mask)
        q = tl.load(row_q + offs, mask=tl.where(use_residual, m, False), other=0.0)
        r = tl.maximum(p - tl.math.div_rn(q, q_sum), 0.0)
    else:
        r = tl.where(offs == x_n, 0.0, p)
    return p, r


# K (the drafts, up to KPAD) does not specialize: Triton would compile K = 0, K = 1 and other K
# apart, and the verifier's warm-up (triton_verification.warm_up) covers each KPAD once.
@triton.jit(do_not_specialize=["K"])
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
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            m = offs < V
            p, r = residual_block(row_p, row_q, offs, m, use_residual, q_sum, x_n, HAS_Q)
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
            p, r = residual_block(row_p, row_q, offs, m, use_residual, q_sum, x_n, HAS_Q)
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
