"""Verify engine: one target forward over appended + draft tokens, then speculative sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument
from specdec.proposals import IDS_ONLY, Proposal, decode_proposal
from specdec.sampling import STREAM_VERIFY, SamplingParams, logits_to_probs, position_noise
from specdec.serving import ServingModel
from specdec.verification import greedy_verify, rejection_sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyOut:
    output_token_ids: list[int]  # accepted drafts + one recovered / bonus token
    num_accepted: int
    kv_length: int  # committed + accepted drafts; the last output token is not cached yet


class VerifierEngine(ServingModel):
    role = "verifier"

    def verify(
        self,
        session_id: str,
        truncate_to: int,
        append_token_ids: list[int],
        draft_token_ids: list[int],
        proposal: Proposal | None,
        params: SamplingParams,
    ) -> VerifyOut:
        k = len(draft_token_ids)
        self.check_request(truncate_to, append_token_ids, k, params, draft_field="draft_token_ids")
        self.check_token_ids(draft_token_ids, "draft_token_ids")
        vocab = self.lm.vocab_size
        q = None
        if k and not params.greedy:
            if proposal is None:
                raise InvalidArgument("proposal", "sampled verification of drafts needs the proposal they were drawn from")
            q = decode_proposal(proposal, k, vocab)  # validated before touching the session
            if proposal.kind == IDS_ONLY and proposal.shape != (k,):
                raise InvalidArgument("proposal.shape", f"ids-only proposals are [{k}], got {list(proposal.shape)}")
        return self.run(self._verify, session_id, truncate_to, append_token_ids, draft_token_ids, q, params)

    def _verify(
        self,
        session_id: str,
        truncate_to: int,
        append_token_ids: list[int],
        draft_token_ids: list[int],
        q: torch.Tensor | None,  # [K, V] proposal, None for greedy or one-hot
        params: SamplingParams,
    ) -> VerifyOut:
        k = len(draft_token_ids)
        vocab = self.lm.vocab_size
        with self.sessions.use(session_id, truncate_to) as session:
            seed = params.seed if params.seed is not None else session.seed
            first_pos = truncate_to + len(append_token_ids)  # absolute position of the first draft / new token
            logits = self.lm.forward(append_token_ids + draft_token_ids, session.cache, logits_to_keep=k + 1)  # [K+1, V]
            drafts = torch.tensor([draft_token_ids], dtype=torch.long).reshape(1, k)  # [1, K]
            num_draft = torch.tensor([k])
            if params.greedy:
                out = greedy_verify(logits.argmax(dim=-1)[None], drafts, num_draft)
            else:
                p = logits_to_probs(logits, params)[None]  # [1, K+1, V]
                uniform, noise = position_noise(seed, STREAM_VERIFY, list(range(first_pos, first_pos + k + 1)), vocab)
                out = rejection_sample(
                    p, drafts, None if q is None else q[None], num_draft, uniform[None, :k], noise[None]
                )
            n_acc = int(out.num_accepted[0])
            emitted = out.output_token_ids[0, : n_acc + 1].tolist()
            # Keep the accepted drafts cached; drop the rejected tail.
            session.length = first_pos + n_acc
            self.lm.crop(session.cache, session.length)
            self.stats.add(forwards=1, draft_tokens=k, accepted_tokens=n_acc, emitted_tokens=n_acc + 1)
            log.debug("verify session=%s truncate_to=%d appended=%d drafts=%d accepted=%d kv=%d",
                      session_id, truncate_to, len(append_token_ids), k, n_acc, session.length)
            return VerifyOut(output_token_ids=emitted, num_accepted=n_acc, kv_length=session.length)
