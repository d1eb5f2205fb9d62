"""Verify engine: one batched target forward over the appended + draft tokens of every
waiting session, then one batched speculative-sampling call."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec import triton_verification
from specdec.argtypes import MAX_DECODE_STEPS
from specdec.batching import WorkItem
from specdec.errors import InvalidArgument, SpecDecError
from specdec.models import ModelSpec, Row
from specdec.proposals import IDS_ONLY, DraftQ, Proposal, decode_draft_q
from specdec.sampling import (
    GREEDY, REJECTION, STREAM_VERIFY, SamplingParams, counter_uniforms, process_logits, ranked_logprobs, seed_tensor,
    top_logprobs,
)
from specdec.serving import DeviceTimer, EngineLoad, ServingModel, drop_closed
from specdec.sessions import Session
from specdec.verification import PLACEHOLDER_TOKEN_ID, to_device, resolve_backend, speculative_sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # of the emitted token under the target's processed (or raw: --logprobs-mode) distribution
    rank: int  # 1 = most likely
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class VerifyOut:
    output_token_ids: list[int]  # accepted drafts + one recovered / bonus token; decode_steps: one per step
    num_accepted: int
    kv_length: int  # committed + accepted drafts; the last output token is not cached yet
    logprobs: list[TokenLogprob] | None = None  # one per output token when requested
    load: EngineLoad = EngineLoad()
    # params.prompt_logprobs: one per appended token after the first, at positions < prompt_length
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class VerifyCall:
    """One session's round, as Verify / VerifyBatch carry it."""

    session_id: str
    truncate_to: int
    append_token_ids: list[int]
    draft_token_ids: list[int]
    proposal: Proposal | None
    params: SamplingParams
    prompt_length: int = 0
    owner: str | None = None  # the caller's credential hash: someone else's session is NOT_FOUND
    decode_steps: int = 1  # target-only steps this round may run (VerifyRequest.decode_steps)


@dataclass
class BatchInFlight:
    """A VerifyBatch between `begin_batch` and `finish_batch`: per call its result, once known."""

    results: list  # VerifyOut | Exception | None, one per call
    held: list = field(default_factory=list)  # (index, the session's context manager, _Request), queued
    futures: list = field(default_factory=list)  # one per `held`, from the scheduler


STARVED_STEPS = 4  # steps a prompt may get no tokens before it goes ahead of shorter ones


@dataclass
class _Request:
    session: Session  # held exclusively by the submitting thread, already truncated
    append_token_ids: list[int]  # what is still to append: chunked prefill moves its head into the session
    draft_token_ids: list[int]
    q: DraftQ | None  # the proposal; None for greedy, typical or one-hot
    params: SamplingParams
    prompt_length: int
    submitted: float = field(default_factory=time.perf_counter)
    queue_ms: float | None = None  # set at the request's first step
    starved_steps: int = 0  # steps in a row that gave this request no tokens at all
    prompt_lp: list[TokenLogprob] = field(default_factory=list)  # params.prompt_logprobs, across its chunks
    decode_steps: int = 1  # steps this round may run; past the first, one sampled token each
    decoded: list[int] = field(default_factory=list)  # the tokens of its steps before the current one
    decoded_lp: list[TokenLogprob] = field(default_factory=list)  # and their logprobs, when asked for
    decoded_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # those steps' step, device and host ms

    def prompt_scored(self, n: int) -> int:
        """How many of the next n appended tokens after the first are prompt tokens to score
        (params.prompt_logprobs): those at positions below prompt_length."""
        if self.params.prompt_logprobs is None:
            return 0
        return max(0, min(n, self.prompt_length - self.session.length - 1))

    @property
    def width(self) -> int:
        """Tokens its final step runs: the rest of the append and every draft."""
        return len(self.append_token_ids) + len(self.draft_token_ids)


def _join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """B x [T_b, V] -> [sum T_b, V]: a view when the parts are consecutive slices of one buffer
    (the slot forward splits one [N, V] output), else a copy."""
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.storage_offset() != offset
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(parts)
        offset += p.numel()
    return first.as_strided((sum(p.shape[0] for p in parts), first.shape[1]), (first.shape[1], 1))


# Dynamic int8 gives a forward row one activation scale: a position's logits would depend on the
# tokens verified beside it, and greedy output on γ (int4 is weight-only: the same for every token).
INT8_REFUSED = ("--quantize int8 is a drafter's option: its activation scale spans a row's tokens, so a verifier's "
                "logits would change with γ; use --quantize int4 (weight-only) or none")


class VerifierEngine(ServingModel):
    role = "verifier"

    def __init__(self, spec: ModelSpec, *args, **kwargs) -> None:
        if spec.quantize == "int8":  # before the weights load
            raise ValueError(INT8_REFUSED)
        super().__init__(spec, *args, **kwargs)
        self.device_timer = DeviceTimer(self.lm.device)  # the engine thread's: every step re-records its events
        if getattr(self.lm, "prefill_slots", None) is not None:  # see cli: the target is one model
            raise ValueError("a verifier scores every row with its own weights: its model takes no prefill copy "
                             "(ModelSpec.prefill_dtype='none')")
        # Checked at start: a "triton" backend without triton or without CUDA is a clear error now,
        # not a failed batch later.
        self.sampler_backend = resolve_backend(self.config.sampler_backend, self.lm.device)
        if self.sampler_backend == "triton" and self.lm.device.type == "cuda":
            start = time.perf_counter()
            try:
                n = triton_verification.warm_up(self.lm.vocab_size, self.config.max_draft_tokens, self.lm.device)
            except Exception:
                if self.config.sampler_backend == "triton":  # asked for by name: a start-up error
                    raise
                log.exception("the Triton sampler kernel failed to build here; falling back to the torch sampler")
                self.sampler_backend = "torch"
            else:
                log.info("sampler kernel: %d variants compiled or loaded in %.1f s", n, time.perf_counter() - start)
        log.info("sampler backend=%s device=%s", self.sampler_backend, self.lm.device)

    def verify(
        self,
        session_id: str,
        truncate_to: int,
        append_token_ids: list[int],
        draft_token_ids: list[int],
        proposal: Proposal | None,
        params: SamplingParams,
        prompt_length: int = 0,
        owner: str | None = None,
        decode_steps: int = 1,
    ) -> VerifyOut:
        """Validates (before the session is touched), holds the session, waits for its batch."""
        return self.verify_call(VerifyCall(session_id, truncate_to, append_token_ids, draft_token_ids, proposal,
                                           params, prompt_length, owner, decode_steps))

    def verify_call(self, call: VerifyCall, alive: Callable[[], bool] | None = None) -> VerifyOut:
        """`verify` of one VerifyCall (what a unary Verify carries). alive: whether the caller
        still waits (its gRPC call's `is_active`): a call given up on stops at its next step."""
        q = self._check(call)
        with self.sessions.use(call.session_id, call.truncate_to, call.owner) as session:
            return self.submit(self._request(call, session, q), alive)

    def verify_batch(self, calls: list[VerifyCall | Exception],
                     alive: Callable[[], bool] | None = None) -> list[VerifyOut | Exception]:
        """Many sessions' rounds at once (VerifyBatch): each call is checked and holds its
        session on its own, all are queued before any is waited for, so they share a step.
        A call that fails (bad input, a busy or unknown session, a failed step) fails alone and
        its session is cropped back to its truncate_to, as a unary call's would be. An
        Exception in `calls` (a malformed message) is passed through as that call's result."""
        return self.finish_batch(self.begin_batch(calls, alive))

    def begin_batch(self, calls: list[VerifyCall | Exception], alive: Callable[[], bool] | None = None) -> BatchInFlight:
        """`verify_batch` without the wait: checks, holds the sessions and queues the rounds;
        `finish_batch` (exactly once) waits, releases the sessions and gives the results."""
        batch = BatchInFlight([None] * len(calls))
        try:
            for i, call in enumerate(calls):
                if isinstance(call, Exception):
                    batch.results[i] = call
                    continue
                try:
                    q = self._check(call)
                    cm = self.sessions.use(call.session_id, call.truncate_to, call.owner)
                    session = cm.__enter__()
                except Exception as exc:  # noqa: BLE001 - this call alone fails
                    batch.results[i] = exc
                    continue
                batch.held.append((i, cm, self._request(call, session, q)))
            batch.futures = self.queue_many([r for _, _, r in batch.held], alive)
        except BaseException:
            self.finish_batch(batch)
            raise
        return batch

    def finish_batch(self, batch: BatchInFlight) -> list[VerifyOut | Exception]:
        results = batch.results
        try:
            for (i, _, _), out in zip(batch.held, self.collect(batch.futures)):
                results[i] = out
        finally:
            for i, cm, _ in batch.held:  # release every session, cropping back the failed ones
                exc = results[i] if isinstance(results[i], Exception) else None
                cm.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        return results  # type: ignore[return-value]

    def _check(self, call: VerifyCall) -> DraftQ | None:
        """Every check that needs no session; returns the decoded proposal (None: one-hot or none)."""
        k = len(call.draft_token_ids)
        params = call.params
        self.check_request(call.truncate_to, call.append_token_ids, k, params, draft_field="draft_token_ids",
                           prompt_length=call.prompt_length)
        self.check_token_ids(call.draft_token_ids, "draft_token_ids")
        if not 0 <= call.decode_steps <= MAX_DECODE_STEPS:
            raise InvalidArgument("decode_steps", f"must be in [0, {MAX_DECODE_STEPS}], got {call.decode_steps}")
        if call.decode_steps > 1 and k:
            raise InvalidArgument("decode_steps", f"{call.decode_steps} steps go with no drafts: a round either "
                                                  f"verifies drafts or decodes target-only, got {k} drafts")
        q = None
        if k and params.method == REJECTION:
            proposal = call.proposal
            if proposal is None:
                raise InvalidArgument("proposal", "sampled verification of drafts needs the proposal they were drawn from")
            # Before the decode: 182 bytes of a sparse proposal for an unknown session cost the
            # server 3 ms each when the decode made a [K, V] q, for nothing.
            self.sessions.require(call.session_id)
            q = decode_draft_q(proposal, k, self.lm.vocab_size)
            if proposal.kind == IDS_ONLY and proposal.shape != (k,):
                raise InvalidArgument("proposal.shape", f"ids-only proposals are [{k}], got {list(proposal.shape)}")
            if q is not None:  # (ids-only: q is one-hot on the draft)
                # A draft its own proposal gives no mass cannot have been sampled from it; accepting
                # it (u·q < p holds for any p > 0 when q = 0) would bias the output towards such drafts.
                q_at_draft = q.at(call.draft_token_ids)  # [K]
                if not bool((q_at_draft > 0).all()):
                    i = int((q_at_draft > 0).logical_not().nonzero()[0, 0])
                    raise InvalidArgument("proposal", f"gives draft token {call.draft_token_ids[i]} at position {i} "
                                                      "probability 0: drafts must be sampled from the proposal sent "
                                                      "with them")
        return q

    @staticmethod
    def _request(call: VerifyCall, session: Session, q: DraftQ | None) -> _Request:
        return _Request(session, call.append_token_ids, call.draft_token_ids, q, call.params, call.prompt_length,
                        decode_steps=max(call.decode_steps, 1))

    def _run_batch(self, items: list[WorkItem]) -> list[WorkItem]:
        """One forward of at most max_batched_tokens tokens. Requests that fit whole are verified;
        a longer append (a prompt) takes a chunk of what is left and comes back in the next
        step (returned unfinished), so it never stalls the others' rounds for more than a chunk.

        Host work is a few tensor builds for the whole batch (one int64 and one float
        host-to-device copy, two more when a row's proposal is a distribution, draws from the
        counter hash of every row at once on the device, logits processed in place per group of
        rows that share their parameters) and one device-to-host read of the results. Each
        phase's time goes to `self.phases`."""
        start = time.perf_counter()
        items = drop_closed(items)
        if not items:
            return []
        reqs, chunks, waiting = self._plan_step([it.payload for it in items])
        stepped = reqs + [r for r, _ in chunks]  # in row order: verified whole, then prompt chunks
        rows, scored = self._rows(reqs, chunks)
        self._note_stepped(stepped, start)
        timer = self.device_timer
        # On the device before the forward is queued: the copies wait for nothing and the
        # sampler is queued right behind the forward. The sampler runs where the logits are:
        # on a GPU, no copy of [B, K + 1, V] back.
        sampler_args = self._sampler_inputs(reqs, self.lm.device) if reqs else None
        prepared = time.perf_counter()
        timer.start()
        logits = self.lm.forward_rows(rows)  # per row [keep, V]
        self._score_prompts(stepped, scored, logits)
        if reqs:
            target, out, raw_logp = self._verify(reqs, scored, logits, sampler_args)
        timer.stop()
        if reqs:
            # The batch's only device-to-host transfer: the accepted counts and the emitted ids.
            results = torch.cat([out.num_accepted[:, None], out.output_token_ids], dim=1).tolist()  # [B, 1 + K + 1]
        synced = time.perf_counter()
        device_ms = timer.ms()
        self._advance_chunks(chunks)
        self.stats.add(forwards=1)
        decoding = []
        if reqs:
            decoding = self._reply(items, reqs, target, raw_logp, results,
                                   self._load(rows, (synced - start) * 1e3, device_ms))
        end = time.perf_counter()
        self.phases.step((prepared - start) * 1e3, device_ms, (end - prepared) * 1e3 - device_ms,
                         (end - start) * 1e3)
        # Back first in the next step, which waits for no company: a waiting prompt's next chunk,
        # and a decode_steps round's next token (its row stays in the batch, as a scheduler's
        # running request does).
        unfinished = {id(r) for r in waiting} | {id(r) for r, _ in chunks} | {id(r) for r in decoding}
        return [it for it in items if id(it.payload) in unfinished]

    def _rows(self, reqs: list[_Request], chunks: list[tuple[_Request, list[int]]]) -> tuple[list[Row], list[int]]:
        """The step's rows, and per row how many prompt tokens it scores (prompt_logprobs). A
        row keeps the logits of its last `keep` positions: the verified ones (a chunk's last,
        unused), or all of them when its head has prompt tokens to score."""
        scored = [r.prompt_scored(len(r.append_token_ids) - 1) for r in reqs]
        scored += [r.prompt_scored(len(chunk)) for r, chunk in chunks]
        rows = [Row(r.session.cache, r.append_token_ids + r.draft_token_ids,
                    r.width if n else len(r.draft_token_ids) + 1) for r, n in zip(reqs, scored)]
        rows += [Row(r.session.cache, chunk, len(chunk) if n else 1)
                 for (r, chunk), n in zip(chunks, scored[len(reqs):])]
        return rows, scored

    def _note_stepped(self, stepped: list[_Request], start: float) -> None:
        """A request's queue time ends at its first step; its session stays fresh for the
        running-sessions window while a long prompt's chunks run (counted after the step)."""
        for r in stepped:
            if r.queue_ms is None:
                r.queue_ms = (start - r.submitted) * 1e3
                self.phases.observe("queue", r.queue_ms)
        self.running.touch([r.session.session_id for r in stepped], time.monotonic())

    def _verify(self, reqs: list[_Request], scored: list[int], logits: list[torch.Tensor],
                sampler_args: dict) -> tuple[torch.Tensor, object, list[torch.Tensor | None]]:
        """The verified rows' processed target distribution [B, K + 1, V], the sampler's output,
        queued on the device (nothing read back yet), and per request its raw log-probabilities
        [K_b + 1, V] where --logprobs-mode raw_logprobs reports them (else None)."""
        # B x [K_b + 1, V]: a row that scored its prompt keeps its verified tail
        logits = [row[-(len(r.draft_token_ids) + 1):] if n else row for r, n, row in zip(reqs, scored, logits)]
        raw = self.config.logprobs_mode == "raw_logprobs"
        # Taken before processing, which may work on the same storage.
        raw_logp = [torch.log_softmax(row.float(), dim=-1) if raw and r.params.logprobs is not None else None
                    for r, row in zip(reqs, logits)]
        target = self._process_logits(reqs, logits)  # [B, K + 1, V]
        return target, speculative_sample(target, backend=self.sampler_backend, **sampler_args), raw_logp

    def _load(self, rows: list[Row], step_ms: float, device_ms: float) -> EngineLoad:
        """What every reply of this step reports. Sessions are counted after the step: those that
        arrived while it ran count in its replies too (the first reply to sessions starting
        together would otherwise see only the first of them)."""
        running = self.note_running([])
        return EngineLoad(running_sessions=running, step_rows=len(rows),
                          step_tokens=sum(len(row.token_ids) for row in rows), step_ms=step_ms,
                          speculation_disabled=0 < self.config.speculative_disable_by_batch_size <= running,
                          device_ms=device_ms, host_ms=max(step_ms - device_ms, 0.0))

    def _reply(self, items: list[WorkItem], reqs: list[_Request], target: torch.Tensor,
               raw_logp: list[torch.Tensor | None], results: list[list[int]], load: EngineLoad) -> list[_Request]:
        """Settle each verified request with its accepted prefix and next token; one that fails
        (a distribution without mass) fails alone. Returns the decode_steps rounds that go on:
        their token is cached by their next step, which samples the one after it."""
        by_request = {id(it.payload): it for it in items}
        going_on = []
        for i, r in enumerate(reqs):
            item = by_request[id(r)]
            try:
                out = self._finish(r, target[i], results[i][0], results[i][1:],
                                   dataclasses.replace(load, queue_ms=r.queue_ms), raw_logp[i])
                spent = (out.load.step_ms, out.load.device_ms, out.load.host_ms)
                if self._decodes_on(r, out.output_token_ids[-1]):
                    r.decoded += out.output_token_ids
                    r.decoded_lp += out.logprobs or []
                    r.decoded_ms = tuple(a + b for a, b in zip(r.decoded_ms, spent))
                    r.append_token_ids, r.draft_token_ids, r.q = out.output_token_ids[-1:], [], None
                    going_on.append(r)
                    continue
                if r.decoded:  # the round's engine time is its steps' (the load's rows: the last step's)
                    step_ms, device_ms, host_ms = (a + b for a, b in zip(r.decoded_ms, spent))
                    out = dataclasses.replace(
                        out, output_token_ids=r.decoded + out.output_token_ids,
                        logprobs=None if out.logprobs is None else r.decoded_lp + out.logprobs,
                        load=dataclasses.replace(out.load, step_ms=step_ms, device_ms=device_ms, host_ms=host_ms))
                item.future.set_result(out)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                item.future.set_exception(exc)
        return going_on

    def _decodes_on(self, r: _Request, token: int) -> bool:
        """Whether a decode_steps round runs another step after emitting `token`: steps left, no
        stop (the processors masked EOS and stop_token_ids while min_tokens outputs were
        missing, so a sampled one ends the generation) and room in the context for the token."""
        if len(r.decoded) + 1 >= r.decode_steps:
            return False
        if token in r.params.stop_token_ids or (token in self.info.eos_token_ids and not r.params.ignore_eos):
            return False
        return r.session.length + 1 <= self.lm.max_context

    def _sampler_inputs(self, reqs: list[_Request], device: torch.device) -> dict:
        """The sampler's inputs for the whole batch. Every per-row integer (drafts, their count,
        seed, first position) goes to the device in one [B, K + 3] int64 copy and the typical
        thresholds in one [B, 2] float copy (pinned on CUDA, so neither waits for queued work);
        the draws are then computed there from seeds and positions (the counter hash is exact
        integer arithmetic, the same on every device): no [B, K + 1, 2] host buffer at all."""
        b = len(reqs)
        num_draft = [len(r.draft_token_ids) for r in reqs]
        k = max(num_draft)
        # [B, K + 3] int64: drafts (-1 past K_b) | K_b | seed | absolute position of draft 0
        ints = torch.full((b, k + 3), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        if k:
            rows = torch.repeat_interleave(torch.arange(b), torch.tensor(num_draft))
            cols = torch.cat([torch.arange(n) for n in num_draft])
            ints[rows, cols] = torch.tensor([t for r in reqs for t in r.draft_token_ids], dtype=torch.long)
        ints[:, k] = torch.tensor(num_draft)
        ints[:, k + 1] = seed_tensor([r.session.seed_for(r.params) for r in reqs])
        ints[:, k + 2] = torch.tensor([r.session.length + len(r.append_token_ids) for r in reqs])
        floats = torch.tensor([[r.params.posterior_threshold, r.params.posterior_alpha] for r in reqs])  # [B, 2]
        ints, floats = to_device(ints, device), to_device(floats, device)
        drafts = ints[:, :k]  # [B, K]
        draws = None
        if any(r.params.method != GREEDY for r in reqs):
            # [B, K + 1, 2]: every row's positions at once; rows past K_b + 1 and greedy rows are never read
            positions = ints[:, k + 2:] + torch.arange(k + 1, device=device)[None, :]  # [B, K + 1]
            draws = counter_uniforms(ints[:, k + 1], STREAM_VERIFY, positions)
        q = q_sums = None
        if any(r.q is not None for r in reqs):
            q, q_sums = self._draft_probs(reqs, k, device)
        return dict(draft_token_ids=drafts, draft_probs=q, num_draft=ints[:, k], draws=draws,
                    methods=[r.params.method for r in reqs], posterior_threshold=floats[:, 0],
                    posterior_alpha=floats[:, 1], q_sums=q_sums)

    def _draft_probs(self, reqs: list[_Request], k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's q [B, K, V] on the device and its row sums [B, K]. Sparse and one-hot rows
        cross as ids + probs [B, K, N] (N: the widest top-N) and are scattered into a zeroed
        [B, K, V] there: at B = 32, K = 8 and a 152k vocabulary the dense buffer is 155 MB,
        which the host would otherwise fill and copy every step. A dense proposal is dense on
        the wire too; a batch with one goes dense from the host. Positions past K_b hold id 0
        with mass 1 and are never read; so are the one-hot rows of greedy and typical requests."""
        b, vocab = len(reqs), self.lm.vocab_size
        if all(r.q is None or r.q.ids is not None for r in reqs):
            n = max((r.q.ids.shape[1] for r in reqs if r.q is not None), default=1)
            ids = torch.zeros(b, k, n, dtype=torch.long)  # [B, K, N]
            # [B, K, N + 1]: probs | the row's sum, as its request computed it (a sum over the
            # padded row could round differently with the batch's widest N)
            probs = torch.zeros(b, k, n + 1)
            probs[:, :, 0] = probs[:, :, n] = 1.0
            for i, r in enumerate(reqs):
                kb = len(r.draft_token_ids)
                if r.q is not None:
                    width = r.q.ids.shape[1]
                    ids[i, :kb, :width], probs[i, :kb, :width], probs[i, :kb, n] = r.q.ids, r.q.probs, r.q.sums
                else:  # one-hot q of an ids-only proposal: (p - q)+ is p without the draft
                    ids[i, :kb, 0] = torch.tensor(r.draft_token_ids, dtype=torch.long)
            ids, probs = to_device(ids, device), to_device(probs, device)
            q = torch.zeros(b, k, vocab, device=device).scatter_add_(2, ids, probs[:, :, :n])
            return q, probs[:, :, n]
        q = torch.ones(b, k, vocab)  # [B, K, V]
        q_sums = torch.ones(b, k)  # [B, K]
        for i, r in enumerate(reqs):
            kb = len(r.draft_token_ids)
            if r.q is not None:
                q[i, :kb] = r.q.dense(vocab)
                q_sums[i, :kb] = r.q.sums
            else:
                q[i, :kb] = 0.0
                q[i, torch.arange(kb), torch.tensor(r.draft_token_ids, dtype=torch.long)] = 1.0
        return to_device(q, device), to_device(q_sums, device)

    def _process_logits(self, reqs: list[_Request], logits: list[torch.Tensor]) -> torch.Tensor:
        """B x [K_b + 1, V] raw logits -> [B, K + 1, V] processed target distributions; rows past
        K_b + 1 are never read. Each pass over [N, V] costs as much as the LM head's output (on
        a CPU with a 49k vocabulary it is most of the step), so: rows that share their sampling
        parameters (and need no context: no penalties, no min_tokens) are processed as one stack
        (the processors are row-wise, so a row's values are the same as alone); an all-greedy
        batch without logprobs keeps the raw logits (greedy matching reads only their argmax,
        which softmax preserves); and when every request has the same width the result is a
        view, not a scatter into a fresh [B, K + 1, V]."""
        b, vocab = len(reqs), self.lm.vocab_size
        widths = [len(r.draft_token_ids) + 1 for r in reqs]
        flat = _join_rows(logits)  # [N, V], N = sum of widths
        contextual = [i for i, r in enumerate(reqs) if r.params.has_own_processors]
        raw = not contextual and all(r.params.greedy and r.params.logprobs is None for r in reqs)
        if not raw:
            starts = [0]
            for w in widths:
                starts.append(starts[-1] + w)
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(reqs):
                if i not in contextual:
                    p = r.params
                    groups.setdefault((p.greedy, p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
            if len(groups) == 1 and not contextual:
                flat = process_logits(flat, reqs[0].params)
            else:
                out = torch.empty_like(flat)
                for idx in groups.values():
                    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in idx]).to(flat.device)
                    out[rows] = process_logits(flat[rows], reqs[idx[0]].params)
                for i in contextual:
                    r = reqs[i]
                    ctx = self.token_context(r.session.tokens + r.append_token_ids, r.prompt_length)
                    out[starts[i]:starts[i + 1]] = process_logits(flat[starts[i]:starts[i + 1]], r.params, ctx,
                                                                  r.draft_token_ids)
                flat = out
        if len(set(widths)) == 1:
            return flat.view(b, widths[0], vocab)
        target = torch.zeros(b, max(widths), vocab, device=flat.device)
        rows = torch.repeat_interleave(torch.arange(b), torch.tensor(widths)).to(flat.device)
        cols = torch.cat([torch.arange(w) for w in widths]).to(flat.device)
        target[rows, cols] = flat
        return target

    def _plan_step(self, reqs: list[_Request]) -> tuple[list[_Request], list[tuple[_Request, list[int]]], list[_Request]]:
        """Split a step's token budget as vLLM's chunked prefill does: decode rounds first (a
        verify of a few tokens, in arrival order), then the longer appends (prompts), whole or
        as a chunk of what budget is left; the rest waits for the next step. Something always
        advances. Prompts go shortest first: a 40-token prompt arriving just after a 320-token
        one gets its first token in this step instead of two steps later (in arrival order,
        median TTFT at concurrency 4 depended on which request's bytes reached the server
        first). A prompt that got no tokens for STARVED_STEPS steps in a row goes first.
        Returns (verified whole, [(request, chunk of its append)], waiting)."""
        left = self.max_batched_tokens
        whole, chunks, waiting = [], [], []
        short = self.config.max_draft_tokens + 2  # the widest decode round: drafts, a catch-up token, the last
        prompts = sorted((r for r in reqs if r.width > short),
                         key=lambda r: (r.starved_steps < STARVED_STEPS, r.width))  # stable: arrival order on ties
        for r in [r for r in reqs if r.width <= short] + prompts:
            if r.width <= left:
                whole.append(r)
                left -= r.width
            elif len(r.append_token_ids) > 1 and (left > 0 or not (whole or chunks)):
                # Keep at least the last appended token for the final step: its logits start the verify.
                n = min(max(left, 1), len(r.append_token_ids) - 1)
                chunks.append((r, r.append_token_ids[:n]))
                left -= n
            else:
                waiting.append(r)
        starved = {id(r) for r in waiting}
        for r in reqs:
            r.starved_steps = r.starved_steps + 1 if id(r) in starved else 0
        return whole, chunks, waiting

    @staticmethod
    def _score_prompts(stepped: list[_Request], scored: list[int], logits: list[torch.Tensor]) -> None:
        """prompt_logprobs: the first n = scored[i] logits of a row [n, V] predict the n appended
        tokens after its first (for a chunk, the last of them opens the next chunk, which always
        exists). Raw: vLLM's prompt logprobs are the model's own distribution, before any
        sampling parameter."""
        for r, n, row in zip(stepped, scored, logits):
            if n:
                logp = torch.log_softmax(row[:n].float(), dim=-1)
                r.prompt_lp.extend(TokenLogprob(*x) for x in ranked_logprobs(logp, r.append_token_ids[1 : n + 1],
                                                                              r.params.prompt_logprobs))

    def _advance_chunks(self, chunks: list[tuple[_Request, list[int]]]) -> None:
        """The chunks are in their sessions' caches now: move them from the requests' appends."""
        for r, chunk in chunks:
            r.session.tokens.extend(chunk)
            r.session.length = len(r.session.tokens)
            r.append_token_ids = r.append_token_ids[len(chunk):]

    def _finish(self, r: _Request, p: torch.Tensor, n_acc: int, row: list[int], load: EngineLoad,
                raw_logp: torch.Tensor | None = None) -> VerifyOut:
        """p: [>= n_acc + 1, V] the processed target distribution of r's positions; raw_logp:
        [>= n_acc + 1, V] their raw log-probabilities, which the logprobs report when given."""
        session = r.session
        k = len(r.draft_token_ids)
        emitted = row[: n_acc + 1]
        if not all(0 <= t < self.lm.vocab_size for t in emitted):
            # The sampler's answer to a distribution without mass (NaN): the request checks refuse
            # the parameters known to make one; should another appear, this request alone fails.
            raise SpecDecError(f"session {session.session_id}: the processed target distribution had no token "
                               "with probability > 0")
        logprobs = None
        if r.params.logprobs is not None:
            entries = (top_logprobs(p[: n_acc + 1], emitted, r.params.logprobs) if raw_logp is None
                       else ranked_logprobs(raw_logp[: n_acc + 1], emitted, r.params.logprobs))
            logprobs = [TokenLogprob(*x) for x in entries]
        # Keep the appended tokens and the accepted drafts cached; drop the rejected tail.
        session.tokens.extend(r.append_token_ids + r.draft_token_ids[:n_acc])
        session.length = len(session.tokens)
        self.lm.crop(session.cache, session.length)
        self.stats.add(draft_tokens=k, accepted_tokens=n_acc, emitted_tokens=n_acc + 1)
        log.debug("verify session=%s appended=%d drafts=%d accepted=%d kv=%d",
                  session.session_id, len(r.append_token_ids), k, n_acc, session.length)
        return VerifyOut(output_token_ids=emitted, num_accepted=n_acc, kv_length=session.length, logprobs=logprobs,
                         load=load, prompt_logprobs=r.prompt_lp if r.params.prompt_logprobs is not None else None)
