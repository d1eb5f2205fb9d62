"""Batched speculative verification: tensors in, tensors out.

Shapes follow vLLM v1's rejection sampler and FlashInfer's `chain_speculative_sampling`:
a batch of B requests, each with up to K draft tokens (ragged via `num_draft`), and the
target's distribution at K + 1 positions (the K drafts and the bonus position). Output
rows are padded with -1 (`PLACEHOLDER_TOKEN_ID`) after the last emitted token.

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

from specdec.sampling import sample_with_noise

PLACEHOLDER_TOKEN_ID = -1


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


def _emit(
    draft_token_ids: torch.Tensor, final_token_ids: torch.Tensor, num_accepted: torch.Tensor
) -> VerifyOutput:
    """Accepted drafts, then final_token_ids[num_accepted], then -1 padding.

    draft_token_ids: [B, K]; final_token_ids: [B, K + 1] (token emitted if the chain stops there).
    """
    b, k1 = final_token_ids.shape
    cols = torch.arange(k1, device=final_token_ids.device)[None, :]
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((b, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    last = final_token_ids.gather(1, num_accepted[:, None])
    out = torch.where(cols < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    out = torch.where(cols == num_accepted[:, None], last, out)
    return VerifyOutput(output_token_ids=out, num_accepted=num_accepted, num_emitted=num_accepted + 1)


def greedy_verify(
    target_argmax: torch.Tensor,  # [B, K + 1] int64, argmax of the target logits at each position
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    num_draft: torch.Tensor,  # [B] int64
) -> VerifyOutput:
    """Greedy matching: accept drafts while they equal the target's argmax."""
    k = draft_token_ids.shape[1]
    accept = draft_token_ids == target_argmax[:, :k]
    return _emit(draft_token_ids, target_argmax, _accepted_prefix(accept, num_draft))


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K + 1, V] float32, processed target distribution p
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 past num_draft
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 proposal q, or None for one-hot q (ids-only)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= K
    uniform: torch.Tensor,  # [B, K] float32 in [0, 1), the acceptance draws
    exp_noise: torch.Tensor,  # [B, K + 1, V] float32 Exp(1), the recovery / bonus draws
) -> VerifyOutput:
    """Exact speculative sampling over a ragged batch; see the module docstring.

    q rows need not be normalized: they are normalized here, which is the distribution a
    drafter sampling with `argmax(q / Exp(1))` actually sampled from.

    Example:
        >>> V = 4; p = torch.full((1, 2, V), 0.25); q = torch.tensor([[[1.0, 0, 0, 0]]])
        >>> out = rejection_sample(p, torch.tensor([[0]]), q, torch.tensor([1]),
        ...                        torch.tensor([[0.1]]), torch.ones(1, 2, V))
        >>> out.num_accepted.tolist(), out.num_emitted.tolist()
        ([1], [2])
    """
    b, k = draft_token_ids.shape
    positions = torch.arange(k, device=target_probs.device)[None, :]
    safe_ids = draft_token_ids.clamp_min(0)[..., None]  # [B, K, 1]
    p_draft = target_probs[:, :k].gather(2, safe_ids)[..., 0]  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        # (p - onehot(x))+ is p with x removed.
        residual = target_probs[:, :k].scatter(2, safe_ids, 0.0)
    else:
        q = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
        q_draft = q.gather(2, safe_ids)[..., 0]
        residual = (target_probs[:, :k] - q).clamp_min_(0.0)
    accept = uniform * q_draft < p_draft
    num_accepted = _accepted_prefix(accept, num_draft)

    # Distribution each position would emit from if the chain stopped there:
    # the residual at a rejected draft position, p itself at the bonus position (index num_draft).
    # A residual that is all zero means p == q there, where rejection has probability 0;
    # falling back to p keeps the unused row well defined.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_probs[:, :k])
    is_bonus = (positions == num_draft[:, None])[..., None]  # [B, K, 1]
    stop_dist = torch.cat([torch.where(is_bonus, target_probs[:, :k], residual), target_probs[:, k:]], dim=1)
    final_token_ids = sample_with_noise(stop_dist, exp_noise)  # [B, K + 1]
    return _emit(draft_token_ids, final_token_ids, num_accepted)
