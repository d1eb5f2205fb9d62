"""Prompt-lookup drafter engine (`specdec drafter --backend ngram`): no model, just ids.

Each session keeps the ids the client sent (prompt + generated) plus the drafts it
proposed, under the same contract as the model drafter (truncate_to, append_token_ids;
after a Draft it holds committed + drafts[:-1], and kv_length says so). Drafts come from
`specdec.ngram.ngram_propose` and may be fewer than asked, or none. Whatever proposal
form the client asked for, the answer is ids-only: a deterministic draft is exactly a
one-hot q, which the verifier checks losslessly (accept with p(x), else resample from p
without x). The tokenizer, vocab size, EOS ids and context are `--model`'s, read without
its weights, so the client's compatibility checks against the verifier hold.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from drafter_service.engine import Drafter, DraftOut
from specdec.batching import WorkItem
from specdec.models import ModelSpec, TokenOnlyLM
from specdec.ngram import ngram_propose
from specdec.proposals import IDS_ONLY, Proposal, ProposalFormat
from specdec.sampling import SamplingParams
from specdec.serving import EngineConfig, EngineLoad
from specdec.sessions import Session

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Request:
    session: Session  # held exclusively by the submitting thread, already truncated
    append_token_ids: list[int]
    num_draft_tokens: int


class NgramDrafterEngine(Drafter):

    def __init__(self, spec: ModelSpec, config: EngineConfig = EngineConfig(), n_min: int = 1, n_max: int = 4,
                 lm: TokenOnlyLM | None = None) -> None:
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"--ngram-min must be >= 1 and --ngram-max >= --ngram-min, got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        super().__init__(spec, config, lm=lm or TokenOnlyLM(spec))
        name = spec.display_name.rsplit("[", 1)[0]  # the tokenizer's model, without a dtype it never loads
        self.info = dataclasses.replace(self.info, model=f"ngram[{n_min}-{n_max}]:{name}", dtype="none")

    def _request(self, session: Session, append_token_ids: list[int], num_draft_tokens: int, params: SamplingParams,
                 fmt: ProposalFormat, prompt_length: int, fanout: int) -> _Request:
        """`params`, `fmt` and `fanout` were only validated: the proposal is ids-only whatever
        was asked (q is one-hot on the draft), and a lookup costs too little to pre-draft the
        next round."""
        return _Request(session, append_token_ids, num_draft_tokens)

    def _run_batch(self, items: list[WorkItem]) -> None:
        """Every request's lookup, then the replies, with the load of the step: the client's
        load model counts only drafters that report one (EngineLoad.step_rows > 0), and without
        it γ ignored how many sessions share the verifier. A lookup drafts all γ ids at once: its
        time is reported per draft, as a model drafter reports one step per draft."""
        start = time.perf_counter()
        outs: list[DraftOut | Exception] = []
        for item in items:
            try:
                outs.append(self._draft_one(item.payload))
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                outs.append(exc)
        step_ms = (time.perf_counter() - start) * 1e3
        drafts = max((len(o.draft_token_ids) for o in outs if isinstance(o, DraftOut)), default=0)
        per_draft_ms = step_ms / max(drafts, 1)
        load = EngineLoad(running_sessions=self.note_running([it.payload.session.session_id for it in items]),
                          step_rows=len(items), step_tokens=len(items), step_ms=per_draft_ms, device_ms=per_draft_ms)
        for item, out in zip(items, outs):
            if isinstance(out, Exception):
                item.future.set_exception(out)
            else:
                item.future.set_result(dataclasses.replace(out, load=load))

    def _draft_one(self, r: _Request) -> DraftOut:
        session = r.session
        session.tokens.extend(r.append_token_ids)
        drafts = ngram_propose(session.tokens, r.num_draft_tokens, self.n_min, self.n_max)
        session.tokens.extend(drafts[:-1])  # as the model drafter: every draft but the last is held
        session.length = len(session.tokens)
        self.stats.add(draft_tokens=len(drafts))
        log.debug("draft session=%s appended=%d drafts=%d kv=%d",
                  session.session_id, len(r.append_token_ids), len(drafts), session.length)
        return DraftOut(draft_token_ids=drafts, proposal=Proposal(kind=IDS_ONLY, dtype="float32", shape=(len(drafts),)),
                        kv_length=session.length)
