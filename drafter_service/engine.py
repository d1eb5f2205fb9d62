"""Draft engine: each waiting session's cache is truncated and extended, then all of them
draft in lockstep, one batched forward per draft position."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specdec.batching import WorkItem
from specdec.models import Row
from specdec.proposals import Proposal, ProposalBuilder, ProposalFormat
from specdec.sampling import STREAM_DRAFT, SamplingParams, position_uniforms, process_logits
from specdec.serving import ServingModel
from specdec.sessions import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftOut:
    draft_token_ids: list[int]
    proposal: Proposal  # exactly the distribution each draft token was sampled from
    kv_length: int


@dataclass
class _Request:
    session: Session  # held exclusively by the submitting thread, already truncated
    append_token_ids: list[int]
    num_draft_tokens: int
    params: SamplingParams
    prompt_length: int
    builder: ProposalBuilder  # samples each draft from, and records, the wire form it will send
    drafts: list[int] = field(default_factory=list)


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
        prompt_length: int = 0,
        owner: str | None = None,
    ) -> DraftOut:
        """Validates (before the session is touched), holds the session, waits for its batch."""
        self.check_request(truncate_to, append_token_ids, num_draft_tokens, params, prompt_length=prompt_length)
        with self.sessions.use(session_id, truncate_to, owner) as session:
            req = _Request(session, append_token_ids, num_draft_tokens, params, prompt_length,
                           ProposalBuilder(fmt, self.lm.vocab_size))
            return self.submit(req)

    def _run_batch(self, items: list[WorkItem]) -> None:
        reqs: list[_Request] = [it.payload for it in items]
        stepped = reqs  # the requests whose rows the latest forward ran, in row order
        logits = self.lm.forward_rows([Row(r.session.cache, r.append_token_ids, 1) for r in reqs])  # [1, V] each
        for r in reqs:
            r.session.tokens.extend(r.append_token_ids)
        forwards = 1
        while True:
            for r, row_logits in zip(stepped, logits):
                if len(r.drafts) < r.num_draft_tokens:
                    self._sample(r, row_logits)
            # Every draft but the last of each request is appended, so the next step drafts after it.
            stepped = [r for r in stepped if len(r.drafts) < r.num_draft_tokens]
            if not stepped:
                break
            for r in stepped:
                r.session.tokens.append(r.drafts[-1])
            logits = self.lm.forward_rows([Row(r.session.cache, [r.drafts[-1]], 1) for r in stepped])
            forwards += 1
        for item, r in zip(items, reqs):
            try:
                item.future.set_result(self._finish(r))
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                item.future.set_exception(exc)
        self.stats.add(forwards=forwards)

    def _sample(self, r: _Request, logits: torch.Tensor) -> None:
        """Draft one token for r from logits [1, V]; penalties see the committed tokens and
        the drafts before it, as the verifier's will."""
        probs = process_logits(logits, r.params, self.token_context(r.session.tokens, r.prompt_length))  # [1, V]
        argmax = int(torch.argmax(probs[0]))
        if r.params.greedy:
            r.drafts.append(r.builder.sample(None, None, argmax))
            return
        position = len(r.session.tokens)  # absolute position of this draft
        u = position_uniforms(r.session.seed_for(r.params), STREAM_DRAFT, [position])[0, 1]
        r.drafts.append(r.builder.sample(probs[0], u, argmax))

    def _finish(self, r: _Request) -> DraftOut:
        session = r.session
        session.length = self.lm.cache_length(session.cache)
        if session.length != len(session.tokens):
            raise RuntimeError(f"drafter cache holds {session.length} tokens, its id list {len(session.tokens)}")
        self.stats.add(draft_tokens=len(r.drafts))
        log.debug("draft session=%s appended=%d drafts=%d kv=%d",
                  session.session_id, len(r.append_token_ids), len(r.drafts), session.length)
        return DraftOut(draft_token_ids=r.drafts, proposal=r.builder.build(), kv_length=session.length)
