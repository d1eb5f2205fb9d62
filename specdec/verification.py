"""Batched speculative verification: tensors in, tensors out.

Shapes follow vLLM v1's rejection sampler and FlashInfer's `chain_speculative_sampling`:
a batch of B requests, each with up to K draft tokens (ragged via `num_draft`), and the
target's distribution at K + 1 positions (the K drafts and the bonus position). Output
rows are padded with -1 (`PLACEHOLDER_TOKEN_ID`) after the last emitted token.

Three acceptance rules, selectable per request and mixed freely in one batch
(`speculative_sample`): exact rejection sampling (default), greedy matching
(temperature 0), and vLLM's typical acceptance (not lossless). `speculative_sample_ragged`
takes vLLM's flat layout: draft tokens of all requests concatenated, with cumulative
counts, and each request's K_i + 1 target rows back to back.

Exactness (Leviathan et al. 2023, Chen et al. 2023): draft token x at position j is
accepted with probability min(1, p_j(x) / q_j(x)), computed as `u * q < p` (no division,
no epsilon); on the first rejection a token is drawn from normalize((p_j - q_j)+); when
all drafts are accepted a bonus token is drawn from p at the next position. The emitted
sequence is then distributed exactly as sampling from p, whatever q the drafts were
sampled from, so the proposal may be compressed (top-N, float16, one-hot) as long as
the drafter samples from exactly what it sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import triton_verification
from specdec.sampling import GREEDY, REJECTION, TYPICAL, sample_inverse_cdf

PLACEHOLDER_TOKEN_ID = -1
# vLLM's epsilon inside log(p + eps) for the posterior entropy of typical acceptance.
_TYPICAL_ENTROPY_EPS = 1e-5


@dataclass(frozen=True)
class VerifyOutput:
    output_token_ids: torch.Tensor  # [B, K + 1] int64, -1 after the last emitted token
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens
    num_emitted: torch.Tensor  # [B] int64, num_accepted + 1 (the recovered or bonus token)


def _accepted_prefix(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Length of the all-accepted prefix of each row.

    accept: [B, K] bool; num_draft: [B] -> [B] int64.
    """
    k = accept.shape[1]
    in_range = torch.arange(k, device=accept.device)[None, :] < num_draft[:, None]
    return torch.cumprod((accept & in_range).long(), dim=1).sum(dim=1)


def _emit(draft_token_ids: torch.Tensor, final_token: torch.Tensor, num_accepted: torch.Tensor) -> VerifyOutput:
    """Accepted drafts, then the final (recovered or bonus) token, then -1 padding.

    draft_token_ids: [B, K]; final_token: [B]; num_accepted: [B] -> output rows [B, K + 1].
    """
    b, k = draft_token_ids.shape
    cols = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((b, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    out = torch.where(cols < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    out = torch.where(cols == num_accepted[:, None], final_token[:, None], out)
    return VerifyOutput(output_token_ids=out, num_accepted=num_accepted, num_emitted=num_accepted + 1)


def greedy_verify(
    target_argmax: torch.Tensor,  # [B, K + 1] int64, argmax of the target logits at each position
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    num_draft: torch.Tensor,  # [B] int64
) -> VerifyOutput:
    """Greedy matching: accept drafts while they equal the target's argmax."""
    k = draft_token_ids.shape[1]
    n = _accepted_prefix(draft_token_ids == target_argmax[:, :k], num_draft)
    return _emit(draft_token_ids, target_argmax.gather(1, n[:, None])[:, 0], n)


def _rejection_accept(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot q)
    q_sums: torch.Tensor | None,  # [B, K] row sums of draft_probs
    draws: torch.Tensor,  # [B, K + 1, 2]
) -> torch.Tensor:
    """Accept draft x_j iff u_j * q_j(x_j) < p_j(x_j) (no division, no epsilon) -> [B, K] bool."""
    k = draft_token_ids.shape[1]
    ids = draft_token_ids.clamp_min(0)[..., None]  # [B, K, 1]
    p_draft = target_probs[:, :k].gather(2, ids)[..., 0]  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        # q rows need not be normalized: a drafter sampling by inverse CDF samples normalize(q).
        q_draft = draft_probs.gather(2, ids)[..., 0] / q_sums
    return draws[:, :k, 0] * q_draft < p_draft


def _typical_accept(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    posterior_threshold: torch.Tensor,  # [B]
    posterior_alpha: torch.Tensor,  # [B]
) -> torch.Tensor:
    """vLLM's TypicalAcceptanceSampler: accept x_j iff
    p_j(x_j) > min(posterior_threshold, posterior_alpha * exp(-H(p_j))), with
    H(p) = -sum p log(p + 1e-5) -> [B, K] bool."""
    k = draft_token_ids.shape[1]
    p = target_probs[:, :k]
    p_draft = p.gather(2, draft_token_ids.clamp_min(0)[..., None])[..., 0]  # [B, K]
    entropy = -(p * torch.log(p + _TYPICAL_ENTROPY_EPS)).sum(dim=-1)  # [B, K]
    threshold = torch.minimum(posterior_threshold[:, None].expand_as(entropy),
                              posterior_alpha[:, None] * torch.exp(-entropy))
    return p_draft > threshold


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`; on CUDA through pinned memory, so the copy does not
    make the host wait for the work queued before it (a pageable copy synchronizes)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _on_rows(methods: list[str], wanted: set[str], fn, *batch: torch.Tensor) -> torch.Tensor:
    """fn over the rows (dim 0 of every `batch` tensor) whose method is in `wanted`, scattered
    into zeros for the others; fn over the whole batch when every row wants it."""
    rows = [i for i, m in enumerate(methods) if m in wanted]
    if len(rows) == len(methods):
        return fn(*batch)
    index = to_device(torch.tensor(rows, dtype=torch.long), batch[0].device)  # [R]
    out = fn(*(t.index_select(0, index) for t in batch))  # [R, ...]
    return out.new_zeros((len(methods), *out.shape[1:])).index_copy_(0, index, out)


SAMPLER_BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> the fused Triton kernel for CUDA tensors when Triton imports, else torch."""
    if backend not in SAMPLER_BACKENDS:
        raise ValueError(f"sampler backend must be one of {SAMPLER_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_verification.available() else "torch"
    if backend == "triton":
        if not triton_verification.available():
            raise RuntimeError("the triton sampler backend needs the triton package (pip install 'specdec[gpu]')")
        if device.type != "cuda" and not triton_verification.interpreting():
            raise ValueError("the triton sampler backend runs on CUDA tensors (on CPU only with TRITON_INTERPRET=1)")
    return backend


def speculative_sample(
    target_probs: torch.Tensor,  # [B, K + 1, V] float32; greedy rows may hold any distribution with the right argmax
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    draft_probs: torch.Tensor | None,  # [B, K, V] proposal q (one-hot rows for ids-only requests), or None: all one-hot
    num_draft: torch.Tensor,  # [B] int64
    draws: torch.Tensor | None,  # [B, K + 1, 2] float64 uniforms (acceptance, token pick); None if all greedy
    methods: list[str],  # [B] "rejection" | "greedy" | "typical"
    posterior_threshold: torch.Tensor | None = None,  # [B], typical rows only
    posterior_alpha: torch.Tensor | None = None,  # [B], typical rows only
    q_sums: torch.Tensor | None = None,  # [B, K] row sums of draft_probs, if the caller has them
    backend: str = "auto",  # "auto" | "torch" | "triton" (see `resolve_backend`)
) -> VerifyOutput:
    """One batch, each request verified by its own rule, without a host sync.

    The accept tests of every rule in use are computed over [B, K] and merged per row
    (greedy and random requests share the call, as in vLLM's rejection sampler); rules no
    row uses are not computed. Then each request draws exactly one token, at its stop
    position n = num_accepted:
      rejection: normalize((p_n - q_n)+) if a draft was rejected, p_n for the bonus;
      greedy:    argmax p_n;
      typical:   argmax p_n if a draft was rejected, a sample of p_n for the bonus.
    So the V-wide work (residual, cumulative sum) is done once per request, not K + 1 times.
    The "triton" backend fuses the accept loop and that draw into one kernel
    (`specdec.triton_verification`); both backends give the same tokens for the same draws
    (up to float64 summation order in the token pick, ~V * 2^-52 per draw).
    """
    device = target_probs.device
    b, k = draft_token_ids.shape
    if len(methods) != b:
        raise ValueError(f"methods has {len(methods)} entries for a batch of {b}")
    present = set(methods) | ({GREEDY} if not methods else set())
    if present - {GREEDY, REJECTION, TYPICAL}:
        raise ValueError(f"unknown acceptance method(s) {sorted(present - {GREEDY, REJECTION, TYPICAL})}")
    if present - {GREEDY} and draws is None:
        raise ValueError("random rows need draws")
    if TYPICAL in present and (posterior_threshold is None or posterior_alpha is None):
        raise ValueError("typical rows need posterior_threshold and posterior_alpha")
    if draft_probs is not None and q_sums is None:
        q_sums = draft_probs.sum(dim=-1)  # [B, K]: a full read of q; the verifier passes them
    # The target's argmax (greedy rows; typical rows at a rejection) and typical's entropy test read
    # whole [K + 1, V] rows: computed for the rows that use them only.
    target_argmax = typical = None
    if present & {GREEDY, TYPICAL}:
        target_argmax = _on_rows(methods, {GREEDY, TYPICAL}, lambda p: p.argmax(dim=-1), target_probs)  # [B, K + 1]
    if TYPICAL in present:
        typical = _on_rows(methods, {TYPICAL}, _typical_accept, target_probs, draft_token_ids,
                           posterior_threshold.to(device), posterior_alpha.to(device))  # [B, K]
    if resolve_backend(backend, device) == "triton":
        if len(set(methods)) == 1:  # one rule for the batch: a device fill, no host-to-device copy
            codes = torch.full((b,), triton_verification.METHOD_CODES[methods[0]], dtype=torch.int32, device=device)
        else:
            codes = to_device(torch.tensor([triton_verification.METHOD_CODES[m] for m in methods],
                                            dtype=torch.int32), device)
        out, n = triton_verification.chain_verify(
            target_probs, draft_token_ids, draft_probs, q_sums, num_draft.to(device),
            torch.zeros(b, k + 1, 2, dtype=torch.float64, device=device) if draws is None else draws,
            codes, target_argmax, typical)
        return VerifyOutput(output_token_ids=out, num_accepted=n, num_emitted=n + 1)

    is_rejection = to_device(torch.tensor([m == REJECTION for m in methods], dtype=torch.bool), device)  # [B]
    is_typical = to_device(torch.tensor([m == TYPICAL for m in methods], dtype=torch.bool), device)
    accept = torch.zeros(b, k, dtype=torch.bool, device=device)  # [B, K]
    if target_argmax is not None:
        accept = draft_token_ids == target_argmax[:, :k]
    if REJECTION in present:
        accept = torch.where(is_rejection[:, None],
                             _rejection_accept(target_probs, draft_token_ids, draft_probs, q_sums, draws), accept)
    if typical is not None:
        accept = torch.where(is_typical[:, None], typical, accept)
    n = _accepted_prefix(accept, num_draft)  # [B]
    rows = torch.arange(b, device=device)
    p_stop = target_probs[rows, n]  # [B, V]
    rejected = n < num_draft  # [B]: stopped at a rejected draft (else: the bonus position)
    final = p_stop.argmax(dim=-1) if target_argmax is None else target_argmax[rows, n]  # greedy; typical rejections
    if present - {GREEDY}:
        dist = p_stop
        if REJECTION in present and k:
            j = n.clamp_max(k - 1)
            if draft_probs is None:  # (p - onehot(x))+ is p with x removed
                residual = p_stop.scatter(1, draft_token_ids[rows, j].clamp_min(0)[:, None], 0.0)
            else:
                residual = (p_stop - draft_probs[rows, j] / q_sums[rows, j][:, None]).clamp_min_(0.0)
            # An all-zero residual means p == q there, where rejection has probability 0.
            residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_stop)
            dist = torch.where((is_rejection & rejected)[:, None], residual, p_stop)
        sampled = sample_inverse_cdf(dist, draws[rows, n, 1])  # [B]
        use_sample = is_rejection | (is_typical & ~rejected)
        final = torch.where(use_sample, sampled, final)
    return _emit(draft_token_ids, final, n)


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K + 1, V] float32, processed target distribution p
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 proposal q, or None for one-hot q (ids-only)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= K
    draws: torch.Tensor,  # [B, K + 1, 2] float64 uniforms in [0, 1): acceptance, token pick
) -> VerifyOutput:
    """Exact speculative sampling over a ragged batch; see the module docstring.

    Example:
        >>> V = 4; p = torch.full((1, 2, V), 0.25); q = torch.tensor([[[1.0, 0, 0, 0]]])
        >>> draws = torch.tensor([[[0.1, 0.0], [0.0, 0.6]]], dtype=torch.float64)
        >>> out = rejection_sample(p, torch.tensor([[0]]), q, torch.tensor([1]), draws)
        >>> out.output_token_ids.tolist(), out.num_accepted.tolist(), out.num_emitted.tolist()
        ([[0, 2]], [1], [2])
    """
    return speculative_sample(target_probs, draft_token_ids, draft_probs, num_draft, draws,
                              [REJECTION] * draft_token_ids.shape[0])


def typical_acceptance_sample(
    target_probs: torch.Tensor,  # [B, K + 1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    num_draft: torch.Tensor,  # [B] int64
    draws: torch.Tensor,  # [B, K + 1, 2] float64 uniforms; only the bonus pick is random
    posterior_threshold: float | torch.Tensor = 0.09,  # scalar or [B]
    posterior_alpha: float | torch.Tensor = 0.3,  # scalar or [B]
) -> VerifyOutput:
    """Typical acceptance (Medusa §3.3.1, as vLLM defines it). NOT lossless: outputs are
    biased towards likely tokens; see `_typical_accept` for the rule."""
    b = draft_token_ids.shape[0]
    thr = torch.as_tensor(posterior_threshold, dtype=torch.float32, device=target_probs.device).expand(b)
    alpha = torch.as_tensor(posterior_alpha, dtype=torch.float32, device=target_probs.device).expand(b)
    return speculative_sample(target_probs, draft_token_ids, None, num_draft, draws, [TYPICAL] * b, thr, alpha)


def speculative_sample_ragged(
    target_probs: torch.Tensor,  # [T + B, V]: request b's K_b draft positions, then its bonus position
    draft_token_ids: torch.Tensor,  # [T] int64, all requests' drafts back to back
    cu_num_draft_tokens: torch.Tensor,  # [B] int64, cumulative draft counts (vLLM's layout)
    draft_probs: torch.Tensor | None,  # [T, V] or None (all one-hot)
    draws: torch.Tensor | None,  # [T + B, 2] float64 uniforms, laid out like target_probs
    methods: list[str],  # [B]
    posterior_threshold: torch.Tensor | None = None,  # [B]
    posterior_alpha: torch.Tensor | None = None,  # [B]
) -> VerifyOutput:
    """`speculative_sample` over vLLM / FlashInfer's flat ragged layout.

    Returns output_token_ids [B, max_K + 1] padded with -1 after each row's emitted tokens,
    num_accepted [B] (accepted drafts) and num_emitted [B] (= num_accepted + 1).

    Example (two requests with 2 and 0 drafts, greedy):
        >>> p = torch.eye(4)[[1, 2, 3, 0]]  # argmax rows: 1, 2, 3 | 0
        >>> out = speculative_sample_ragged(p, torch.tensor([1, 0]), torch.tensor([2, 2]), None, None,
        ...     ["greedy", "greedy"])
        >>> out.output_token_ids.tolist(), out.num_accepted.tolist()
        ([[1, 2, -1], [0, -1, -1]], [1, 0])
    """
    device = target_probs.device
    cu = cu_num_draft_tokens.to(device=device, dtype=torch.long)
    num_draft = torch.diff(cu, prepend=cu.new_zeros(1))  # [B]
    b = cu.shape[0]
    k = int(num_draft.max()) if b else 0  # the only host read: the padded width
    starts = cu - num_draft  # [B] first draft index of each row
    cols = torch.arange(k + 1, device=device)[None, :]  # [1, K + 1]
    draft_idx = (starts[:, None] + cols[:, :k]).clamp_max(max(draft_token_ids.shape[0] - 1, 0))  # [B, K]
    in_range = cols[:, :k] < num_draft[:, None]
    # Target rows of request b start at starts[b] + b (one bonus row per earlier request).
    target_idx = starts[:, None] + torch.arange(b, device=device)[:, None] + cols.clamp_max(num_draft[:, None])
    padded_drafts = torch.where(in_range, draft_token_ids[draft_idx] if k else draft_token_ids.new_zeros(b, 0),
                                PLACEHOLDER_TOKEN_ID)
    padded_q = None
    if draft_probs is not None:
        padded_q = draft_probs[draft_idx] if k else draft_probs.new_zeros(b, 0, target_probs.shape[1])
        padded_q = torch.where(in_range[..., None], padded_q, 1.0)  # any positive row; never read
    return speculative_sample(
        target_probs[target_idx], padded_drafts, padded_q, num_draft,
        None if draws is None else draws[target_idx], methods, posterior_threshold, posterior_alpha,
    )
