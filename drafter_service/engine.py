"""Draft engine: each waiting session's cache is truncated and extended, then all of them
draft in lockstep, one batched forward per draft position. While no request waits, the
engine pre-drafts the next round of sessions that asked for it (specdec/speculation.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.batching import WorkItem
from specdec.errors import SpecDecError
from specdec.models import CausalLM, ModelSpec, Row
from specdec.proposals import Proposal, ProposalBuilder, ProposalFormat
from specdec.sampling import (
    STREAM_DRAFT, SamplingParams, counter_uniforms, position_uniforms, process_logits, seed_tensor,
)
from specdec.serving import DeviceTimer, EngineConfig, EngineLoad, ServingModel, drop_closed
from specdec.sessions import Session
from specdec.slot_forward import KVSlot, copy_prefix
from specdec.speculation import Branch, SpeculationCache, SpeculationJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftOut:
    draft_token_ids: list[int]
    proposal: Proposal  # exactly the distribution each draft token was sampled from
    kv_length: int
    cached_draft_tokens: int = 0  # drafts that came from the speculation cache
    load: EngineLoad = EngineLoad()


@dataclass
class _Request:
    session: Session  # held exclusively by the submitting thread, already truncated
    append_token_ids: list[int]
    num_draft_tokens: int
    params: SamplingParams
    prompt_length: int
    builder: ProposalBuilder  # samples each draft from, and records, the wire form it will send
    fanout: int = 0
    drafts: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # ids the request's next forward appends
    cached: int = 0  # drafts taken from a pre-drafted branch
    submitted: float = field(default_factory=time.perf_counter)
    queue_ms: float | None = None  # set at the request's first step
    started: bool = False  # its first batch looked for a pre-drafted branch already
    # The engine steps it took part in: [steps, ms, rows, tokens, device ms] summed (EngineLoad is their mean).
    steps: list[float] = field(default_factory=lambda: [0, 0.0, 0, 0, 0.0])

    @property
    def key(self) -> tuple:
        """What a pre-drafted branch must share with this request to stand for its drafts."""
        return (self.params, self.prompt_length, self.builder.fmt, self.session.seed_for(self.params))


class Drafter(ServingModel):
    """The Drafter API that every backend serves (the model here, prompt lookup in
    ngram_engine.py): the request checks, the held and truncated session, one queued
    request. A backend says what it queues (`_request`) and how a batch runs (`_run_batch`)."""

    role = "drafter"
    strict_token_filters = False  # ids past its head are skipped: the verifier checks them

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
        fanout: int = 0,
        alive: Callable[[], bool] | None = None,
    ) -> DraftOut:
        """Validates (before the session is touched), holds the session, waits for its batch.
        fanout > 0: afterwards pre-draft the next round for that many bonus candidates.
        alive: whether the caller still waits (its gRPC call's `is_active`): a call given up on
        stops at its next step."""
        self.check_request(truncate_to, append_token_ids, num_draft_tokens, params, prompt_length=prompt_length,
                           fanout=fanout)
        with self.sessions.use(session_id, truncate_to, owner) as session:
            return self.submit(self._request(session, append_token_ids, num_draft_tokens, params, fmt, prompt_length,
                                             fanout), alive)

    def _request(self, session: Session, append_token_ids: list[int], num_draft_tokens: int, params: SamplingParams,
                 fmt: ProposalFormat, prompt_length: int, fanout: int) -> object:
        raise NotImplementedError


def _argmax_drafts(params: SamplingParams) -> bool:
    """Greedy, and no processor changes a logit: the draft is the raw logits' argmax."""
    return params.greedy and not params.has_own_processors


def _read_tokens(tokens: list[torch.Tensor]) -> list[int]:
    """The step's drafted tokens (0-dim tensors, one per row) in one device-to-host transfer."""
    return torch.stack(tokens).tolist() if tokens else []


class DrafterEngine(Drafter):
    speculation: SpeculationCache | None = None  # set after the engine thread has started

    def __init__(self, spec: ModelSpec, config: EngineConfig = EngineConfig(), lm: CausalLM | None = None) -> None:
        super().__init__(spec, config, lm)
        self.device_timer = DeviceTimer(self.lm.device)  # the engine thread's: every step re-records its events
        # Branches fork the session's KV slot; models without a slot forward do not speculate.
        self.speculation = (SpeculationCache(config.speculation_slots, self.lm.new_cache, copy_prefix)
                            if self.lm.slots is not None and config.speculation_slots > 0 else None)

    def _request(self, session: Session, append_token_ids: list[int], num_draft_tokens: int, params: SamplingParams,
                 fmt: ProposalFormat, prompt_length: int, fanout: int) -> _Request:
        return _Request(session, append_token_ids, num_draft_tokens, params, prompt_length,
                        ProposalBuilder(fmt, self.lm.vocab_size), fanout=fanout, pending=list(append_token_ids))

    def _session_removed(self, session_id: str) -> None:
        # The job holds the session's KV slot (its `source`): on the fast path a slot returns to
        # the pool only with its last reference, so an evicted or expired session's job pinned
        # it until the next Draft's idle step, and admission failed meanwhile.
        if self.speculation is not None:
            self.speculation.drop(session_id)

    def snapshot_stats(self) -> dict[str, int]:
        out = super().snapshot_stats()
        if self.speculation is not None:
            st = self.speculation.stats
            out.update(speculation_hits=st.hits, speculation_partial_hits=st.partial_hits,
                       speculation_misses=st.misses, speculation_draft_tokens=st.draft_tokens,
                       speculation_dropped_branches=st.dropped_branches)
            out["kv_bytes"] += self.speculation.slot_bytes(self.lm.cache_bytes)
        return out

    def _run_batch(self, items: list[WorkItem]) -> list[WorkItem]:
        """Lockstep drafting, one batched forward per draft position. A step runs at most
        max_batched_tokens tokens: one per drafting row, then chunks of the appends (prompts)
        that are longer. A request is answered as soon as its drafts are complete; when only
        prefills are left they are returned unfinished and the next batch resumes them together
        with whatever arrived meanwhile, so a long prompt never stalls the others' drafting."""
        items = drop_closed(items)
        if not items:
            return []
        start = time.perf_counter()
        pending_items = {id(it.payload): it for it in items}  # the requests not settled yet
        reqs: list[_Request] = [it.payload for it in items]
        for r in reqs:
            if r.queue_ms is None:
                r.queue_ms = (start - r.submitted) * 1e3
                self.phases.observe("queue", r.queue_ms)
            if not r.started:
                r.started = True
                self._resume_branch(r)  # a pre-drafted hit leaves nothing pending
        running = self.note_running([r.session.session_id for r in reqs])
        for r in reqs:
            if not r.pending:  # every draft from the speculation cache
                self._settle(pending_items.pop(id(r)), r, running)
        stepped = [r for r in reqs if r.pending]  # the requests whose rows the next forward runs, in row order
        while stepped:
            self._step(stepped, pending_items, running)
            stepped = [r for r in stepped if r.pending]
            if stepped and not any(r.drafts for r in stepped):
                break  # only prefills left: let the next batch take new arrivals along
        return list(pending_items.values())

    def _step(self, stepped: list[_Request], pending_items: dict[int, WorkItem], running: int) -> None:
        """One forward: the next draft of every drafting row, and a chunk of each prompt the
        budget takes; the requests whose drafts are complete are settled."""
        t_step = time.perf_counter()
        rows = self._plan_step(stepped)
        prepared = time.perf_counter()
        timer = self.device_timer
        timer.start()
        logits = self.lm.forward_rows([Row(r.session.cache, chunk, 1) for r, chunk in rows])  # [1, V] each
        drafting = []
        for (r, chunk), row_logits in zip(rows, logits):
            r.session.tokens.extend(chunk)
            r.pending = r.pending[len(chunk):]
            if not r.pending and len(r.drafts) < r.num_draft_tokens:
                drafting.append((r, row_logits))
        drafting = list(zip([r for r, _ in drafting], self._propose_rows(drafting)))
        timer.stop()
        tokens = _read_tokens([t for _, t in drafting])
        synced = time.perf_counter()
        device_ms = timer.ms()
        self.stats.add(forwards=1)  # before any caller is answered: its stats then count its steps
        self._commit(drafting, tokens, pending_items)
        step_ms = (time.perf_counter() - t_step) * 1e3
        step_tokens = sum(len(chunk) for _, chunk in rows)
        for r, _ in rows:
            r.steps[0] += 1
            r.steps[1] += step_ms
            r.steps[2] += len(rows)
            r.steps[3] += step_tokens
            r.steps[4] += device_ms
            if not r.pending and id(r) in pending_items:
                self._settle(pending_items.pop(id(r)), r, running)
        end = time.perf_counter()
        self.phases.step((prepared - t_step) * 1e3, device_ms, (end - synced) * 1e3, (end - t_step) * 1e3)

    def _commit(self, drafting: list[tuple[_Request, torch.Tensor]], tokens: list[int],
                pending_items: dict[int, WorkItem]) -> None:
        """Each drafting row's new draft, read back: recorded, and appended by its next step
        unless it is the last."""
        for (r, _), token in zip(drafting, tokens):
            if not 0 <= token < self.lm.vocab_size:
                # A distribution without mass (NaN) samples id V: this request alone fails (the
                # next forward would embed V and fail the whole batch); the checks refuse the
                # parameters known to make one.
                r.pending = []
                pending_items.pop(id(r)).future.set_exception(SpecDecError(
                    f"session {r.session.session_id}: the processed draft distribution had no token with "
                    "probability > 0"))
                continue
            r.builder.commit(token)
            r.drafts.append(token)
            if len(r.drafts) < r.num_draft_tokens:
                r.pending = [token]

    def _plan_step(self, stepped: list[_Request]) -> list[tuple[_Request, list[int]]]:
        """(request, tokens it appends this step): drafting rows first (one or two tokens each),
        then prefill chunks in arrival order while the budget lasts; the first row always runs."""
        left = self.max_batched_tokens
        rows = []
        for r in sorted(stepped, key=lambda r: len(r.pending) > 2):  # stable: arrival order within each kind
            n = min(len(r.pending), left)
            if n == 0 and rows:
                continue
            rows.append((r, r.pending[:max(n, 1)]))
            left -= n
        return rows

    def _settle(self, item: WorkItem, r: _Request, running: int) -> None:
        steps, ms, rows, tokens, device_ms = r.steps
        mean_ms, mean_device_ms = (ms / steps, device_ms / steps) if steps else (0.0, 0.0)
        load = EngineLoad(running_sessions=running, step_rows=round(rows / steps) if steps else 0,
                          step_tokens=round(tokens / steps) if steps else 0, step_ms=mean_ms,
                          device_ms=mean_device_ms, host_ms=max(mean_ms - mean_device_ms, 0.0),
                          queue_ms=r.queue_ms or 0.0)
        try:
            out = self._finish(r, load)
            self._plan_speculation(r)  # while the session is still held
            item.future.set_result(out)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            item.future.set_exception(exc)

    def _propose_rows(self, drafting: list[tuple[_Request, torch.Tensor]]) -> list[torch.Tensor]:
        """Each drafting row's next draft from its logits [1, V], as 0-dim tensors on their
        device. Rows whose processors need no context (no penalties, min_tokens or token
        filters) go in stacks [R, V]: greedy rows take one argmax over theirs (their draft is
        the raw argmax); sampled rows that share their sampling parameters and wire format
        are processed, drawn (the counter hash of every row's seed and position) and turned
        into wire rows as one stack: the processors are row-wise, so each row gets the draft
        it gets alone, its wire row up to float rounding (a sum over [R, V] on a CPU rounds
        unlike one over [1, V]; the verifier's groups are the same), and it is sampled from
        exactly the row sent. Per row, each tensor call is a kernel launch on a GPU. The
        other rows go one by one."""
        out: list[torch.Tensor | None] = [None] * len(drafting)
        plain = [i for i, (r, _) in enumerate(drafting) if _argmax_drafts(r.key[0])]
        if plain:
            argmax = torch.cat([drafting[i][1] for i in plain]).argmax(dim=-1)  # [R]
            for j, i in enumerate(plain):
                out[i] = drafting[i][0].builder.propose(None, None, argmax[j])
        groups: dict[tuple, list[int]] = {}
        for i, (r, _) in enumerate(drafting):
            p = r.key[0]
            if not (p.greedy or p.has_own_processors):
                groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p, r.builder.fmt), []).append(i)
        for idx in groups.values():
            reqs = [drafting[i][0] for i in idx]
            probs = process_logits(torch.cat([drafting[i][1] for i in idx]), reqs[0].key[0])  # [R, V]
            positions = torch.tensor([[len(r.session.tokens)] for r in reqs])  # [R, 1]: each draft's position
            u = counter_uniforms(seed_tensor([r.key[3] for r in reqs]), STREAM_DRAFT, positions)[:, 0, 1]  # [R]
            u = u.to(probs.device)
            tokens = ProposalBuilder.propose_rows([r.builder for r in reqs], probs, u, probs.argmax(dim=-1))
            for j, i in enumerate(idx):
                out[i] = tokens[j]
        for i, (r, row_logits) in enumerate(drafting):
            if out[i] is None:
                out[i] = self._propose(r.session.tokens, r.key, r.builder, row_logits)
        return out

    def _propose(self, tokens: list[int], key: tuple, builder: ProposalBuilder, logits: torch.Tensor) -> torch.Tensor:
        """One draft after `tokens` from logits [1, V], as a 0-dim tensor on their device (read back
        with the step's other rows, then committed); penalties see the committed tokens and the
        drafts before it, as the verifier's will. key: (params, prompt_length, format, seed)."""
        params, prompt_length, _, seed = key
        probs = process_logits(logits, params, self.token_context(tokens, prompt_length))  # [1, V]
        argmax = torch.argmax(probs[0])
        if params.greedy:
            return builder.propose(None, None, argmax)
        u = position_uniforms(seed, STREAM_DRAFT, [len(tokens)])[0, 1]  # len(tokens): this draft's position
        return builder.propose(probs[0], u, argmax)

    # ---- speculation cache ----------------------------------------------------------

    def _resume_branch(self, r: _Request) -> None:
        """If a pre-drafted branch matches r's sequence, make its slot the session's cache and
        take its drafts; r.pending is then empty (a hit) or the branch's last draft (partial)."""
        if self.speculation is None or not self.speculation.pending(r.session.session_id):
            return
        session = r.session
        if r.num_draft_tokens == 0:
            self.speculation.drop(session.session_id)
            return
        branch = self.speculation.take(session.session_id, session.tokens + r.append_token_ids, r.key)
        if branch is None:
            return
        old, session.cache, session.tokens = session.cache, branch.slot, branch.tokens
        self.speculation.adopt(old)
        n = min(r.num_draft_tokens, len(branch.drafts))
        r.drafts, r.builder, r.cached = branch.drafts[:n], branch.builder, n
        r.builder.keep(n)
        if n == r.num_draft_tokens:
            keep = branch.sequence_len + n - 1  # the contract: the cache holds all drafts but the last
            self.lm.crop(session.cache, keep)
            del session.tokens[keep:]
            r.pending = []
            self.speculation.stats.hits += 1
        else:
            r.pending = [r.drafts[-1]]
            self.speculation.stats.partial_hits += 1

    def _plan_speculation(self, r: _Request) -> None:
        session = r.session
        if (self.speculation is None or r.fanout <= 0 or not r.drafts or len(r.drafts) < r.num_draft_tokens
                or not isinstance(session.cache, KVSlot)
                or len(session.tokens) + 2 + r.num_draft_tokens > self.lm.max_context):
            return
        self.speculation.submit(SpeculationJob(session.session_id, session.cache, list(session.tokens), r.drafts[-1],
                                               r.num_draft_tokens, r.fanout, r.key))
        if session.session_id not in self.sessions:
            # Closed while this Draft ran: its removal dropped no job yet, so this one would
            # hold the session's slot until an idle step noticed. (A close after the submit drops it.)
            self.speculation.drop(session.session_id)

    def _idle(self) -> bool:
        """One batched forward of pre-drafting: each job's probe or its current branch."""
        if self.speculation is None:
            return False
        work = self.speculation.work(self.config.max_batch_size, alive=self.sessions.__contains__)
        if not work:
            return False
        try:
            logits = self.lm.forward_rows([Row(w.slot, w.tokens, 1) for w in work])
            advancing = []
            for w, row_logits in zip(work, logits):
                job, branch = w.job, w.branch
                if branch is None:
                    self._start_branches(job, row_logits)
                else:
                    branch.tokens.extend(w.tokens)
                    advancing.append((job, branch, self._propose(branch.tokens, job.key, branch.builder, row_logits)))
            if advancing:  # (a step of probes alone reads nothing back)
                for (job, branch, _), token in zip(advancing, _read_tokens([t for _, _, t in advancing])):
                    self._advance(job, branch, token)
        except Exception:  # noqa: BLE001 - a failed speculation only loses its branches
            log.exception("speculation step failed; dropping its jobs")
            for w in work:
                self.speculation.drop(w.job.session_id)
        self.stats.add(forwards=1)
        return True

    def _start_branches(self, job: SpeculationJob, logits: torch.Tensor) -> None:
        """The probe's logits after d_γ give the bonus candidates: the drafter's top-`fanout`."""
        params, prompt_length, fmt, _ = job.key
        probs = process_logits(logits, params, self.token_context(job.prefix + [job.last_draft], prompt_length))[0]
        # No more candidates than branch slots: fanout 2**31 - 1 made a branch (a prefix copy) per id.
        top_p, top_i = torch.topk(probs, min(job.fanout, self.speculation.max_branch_slots, probs.shape[-1]))
        candidates = [int(i) for p, i in zip(top_p.tolist(), top_i.tolist()) if p > 0]
        probe = job.branches[0] if job.branches else None  # empty if the session closed meanwhile
        if probe is not None:
            self.lm.crop(probe.slot, len(job.prefix))
        self.speculation.start(job, candidates, lambda: ProposalBuilder(fmt, self.lm.vocab_size))

    def _advance(self, job: SpeculationJob, branch: Branch, token: int) -> None:
        branch.builder.commit(token)
        branch.drafts.append(token)
        branch.pending = [] if branch.done(job.gamma) else [token]
        self.speculation.stats.draft_tokens += 1

    def _finish(self, r: _Request, load: EngineLoad = EngineLoad()) -> DraftOut:
        session = r.session
        session.length = self.lm.cache_length(session.cache)
        if session.length != len(session.tokens):
            raise RuntimeError(f"drafter cache holds {session.length} tokens, its id list {len(session.tokens)}")
        self.stats.add(draft_tokens=len(r.drafts))
        log.debug("draft session=%s appended=%d drafts=%d kv=%d",
                  session.session_id, len(r.append_token_ids), len(r.drafts), session.length)
        return DraftOut(draft_token_ids=r.drafts, proposal=r.builder.build(), kv_length=session.length,
                        cached_draft_tokens=r.cached, load=load)
