"""Draft engine: truncate the session's cache, append the client's tokens, draft gamma tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec.proposals import Proposal, ProposalBuilder, ProposalFormat
from specdec.sampling import STREAM_DRAFT, SamplingParams, logits_to_probs, position_noise
from specdec.serving import ServingModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftOut:
    draft_token_ids: list[int]
    proposal: Proposal  # exactly the distribution each draft token was sampled from
    kv_length: int


class DrafterEngine(ServingModel):
    role = "drafter"

    def draft(
        self,
        session_id: str,
        truncate_to: int,
        append_token_ids: list[int],
        num_draft_tokens: int,
        params: SamplingParams,
        fmt: ProposalFormat = ProposalFormat(),
    ) -> DraftOut:
        self.check_request(truncate_to, append_token_ids, num_draft_tokens, params)
        return self.run(self._draft, session_id, truncate_to, append_token_ids, num_draft_tokens, params, fmt)

    def _draft(
        self,
        session_id: str,
        truncate_to: int,
        append_token_ids: list[int],
        num_draft_tokens: int,
        params: SamplingParams,
        fmt: ProposalFormat,
    ) -> DraftOut:
        with self.sessions.use(session_id, truncate_to) as session:
            seed = params.seed if params.seed is not None else session.seed
            first_pos = truncate_to + len(append_token_ids)  # absolute position of the first draft token
            builder = ProposalBuilder(fmt, self.lm.vocab_size)
            logits = self.lm.forward(append_token_ids, session.cache, logits_to_keep=1)  # [1, V]
            drafts: list[int] = []
            for j in range(num_draft_tokens):
                if j > 0:
                    logits = self.lm.forward([drafts[-1]], session.cache, logits_to_keep=1)
                row = logits[-1]  # [V]
                argmax = int(torch.argmax(row))
                if params.greedy:
                    drafts.append(builder.sample(None, None, argmax))
                    continue
                probs = logits_to_probs(row[None], params)[0]
                _, noise = position_noise(seed, STREAM_DRAFT, [first_pos + j], row.shape[-1])
                drafts.append(builder.sample(probs, noise[0], argmax))
            session.length = self.lm.cache_length(session.cache)
            self.stats.add(forwards=max(1, len(drafts)), draft_tokens=len(drafts))
            log.debug("draft session=%s truncate_to=%d appended=%d drafts=%d kv=%d",
                      session_id, truncate_to, len(append_token_ids), len(drafts), session.length)
            return DraftOut(draft_token_ids=drafts, proposal=builder.build(), kv_length=session.length)
