"""SpeculativeClient: runs draft / verify rounds against the two services.

KV bookkeeping lives here. The client remembers which tokens each service's cache
holds (`drafter_kv`, `verifier_kv`); each round it asks each service to keep the
longest prefix of that which still agrees with the committed sequence (`truncate_to`)
and to append the committed tokens after it. After a rejection the drafter cache holds
drafts past the rejection point: those are dropped by the next call's truncation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import grpc

from specdec.models import ModelSpec, load_tokenizer, tokenizer_fingerprint
from specdec.proposals import DENSE, IDS_ONLY, ProposalFormat
from specdec.sampling import REJECTION, SamplingParams
from specdec.serving import ModelInfo
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS, model_info_from_pb, proposal_format_to_pb, sampling_to_pb
from specdec_rpc.ops import TLSFiles, open_channel

log = logging.getLogger(__name__)


class IncompatibleModels(ValueError):
    """The drafter and verifier (or the client's tokenizer) do not share a vocabulary."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop string or stop token) or "length"
    num_rounds: int = 0
    num_draft_tokens: int = 0  # proposed
    num_accepted_tokens: int = 0  # accepted drafts
    elapsed_s: float = 0.0
    ttft_s: float = 0.0
    draft_time_s: float = 0.0  # time spent in Draft calls (client side)
    verify_time_s: float = 0.0  # time spent in Verify calls (client side)
    token_times_s: list[float] = field(default_factory=list)  # arrival time of each generated token, from start
    target_only: bool = False
    # One entry per generated token when SamplingParams.logprobs is set: its logprob under
    # the target's processed distribution, its rank, and the top-N {token id: logprob}.
    logprobs: list[dict] | None = None
    proposal_bytes: int = 0  # proposal bytes the drafter sent, summed over rounds
    # Faults survived. Fallback rounds ran without drafts because the drafter was
    # unreachable (the output distribution is the same, only slower); every recovery
    # re-created a verifier session and re-prefilled it from the committed tokens.
    drafter_failures: int = 0
    drafter_fallback_rounds: int = 0
    verifier_recoveries: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("token_times_s")
        out["acceptance_rate"] = self.acceptance_rate
        out["tokens_per_s"] = self.tokens_per_s
        out["num_generated_tokens"] = len(self.token_ids)
        return out


@dataclass(frozen=True)
class StreamChunk:
    token_ids: list[int]  # tokens committed this round
    text: str  # new text since the previous chunk
    result: GenerationResult | None = None  # set on the last chunk


def _lcp(cached: Sequence[int], committed: Sequence[int], limit: int) -> int:
    """Length of the common prefix of the cache and the committed sequence, at most `limit`."""
    n = min(len(cached), len(committed), limit)
    for i in range(n):
        if cached[i] != committed[i]:
            return i
    return n


class SpeculativeClient:
    """Speculative decoding over a drafter and a verifier service.

    >>> client = SpeculativeClient("127.0.0.1:50052", drafter="127.0.0.1:50051")
    >>> client.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8)).text
    """

    def __init__(
        self,
        verifier: str,
        drafter: str | None = None,
        *,
        tokenizer=None,
        timeout_s: float = 60.0,
        num_speculative_tokens: int = 4,
        proposal_format: ProposalFormat | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        auth_token: str | None = None,
        recovery_timeout_s: float = 60.0,
    ) -> None:
        """tls_*: PEM paths (any of them turns TLS on; cert + key for mutual TLS);
        auth_token: sent as `authorization: Bearer` on every call. recovery_timeout_s: how
        long a generation keeps retrying a restarting verifier before it fails."""
        self.timeout_s = timeout_s
        self.num_speculative_tokens = num_speculative_tokens
        self.proposal_format = proposal_format
        self.recovery_timeout_s = recovery_timeout_s
        tls = TLSFiles(cert=tls_cert, key=tls_key, ca=tls_ca)
        self._channels = [open_channel(verifier, tls=tls, auth_token=auth_token, options=CHANNEL_OPTIONS)]
        self.verifier = pb_grpc.VerifierStub(self._channels[0])
        self.verifier_info = model_info_from_pb(self.verifier.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout_s))
        self.drafter = None
        self.drafter_info: ModelInfo | None = None
        if drafter:
            self._channels.append(open_channel(drafter, tls=tls, auth_token=auth_token, options=CHANNEL_OPTIONS))
            self.drafter = pb_grpc.DrafterStub(self._channels[1])
            self.drafter_info = model_info_from_pb(self.drafter.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout_s))
            check_compatible(self.drafter_info, self.verifier_info)
        self.tokenizer = tokenizer or load_tokenizer(ModelSpec(model=self.verifier_info.tokenizer_source))
        if tokenizer_fingerprint(self.tokenizer) != self.verifier_info.tokenizer_fingerprint:
            raise IncompatibleModels(
                f"the client's tokenizer differs from the verifier's ({self.verifier_info.model}); "
                "pass the verifier's tokenizer"
            )

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> "SpeculativeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- public API ---------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def effective_gamma(self, gamma: int) -> int:
        """γ as rounds will use it: capped by both services' max_draft_tokens; 0 without a drafter."""
        if gamma <= 0 or self.drafter_info is None:
            return 0
        return min(gamma, self.drafter_info.max_draft_tokens, self.verifier_info.max_draft_tokens)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams = SamplingParams(),
        *,
        num_speculative_tokens: int | None = None,
        target_only: bool = False,
        chat: bool = False,
    ) -> GenerationResult:
        result = None
        for chunk in self.stream(prompt, params, num_speculative_tokens=num_speculative_tokens,
                                 target_only=target_only, chat=chat):
            result = chunk.result
        assert result is not None
        return result

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams = SamplingParams(),
        *,
        num_speculative_tokens: int | None = None,
        target_only: bool = False,
        chat: bool = False,
    ) -> Iterator[StreamChunk]:
        """Yield the tokens committed by each round; the last chunk carries the result."""
        gamma_max = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if gamma_max < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {gamma_max}")
        speculative = not target_only and gamma_max > 0
        if speculative and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter address (or use target_only=True)")
        if speculative:
            gamma_max = self.effective_gamma(gamma_max)
        prompt_ids = self.encode_prompt(prompt, chat)
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenization")
        max_context = self.verifier_info.max_context
        if len(prompt_ids) + params.max_tokens > max_context:
            raise ValueError(
                f"prompt length {len(prompt_ids)} + max_tokens {params.max_tokens} exceeds the verifier's "
                f"maximum context {max_context}"
            )
        yield from self._run(prompt_ids, params, gamma_max if speculative else 0)

    # ---- rounds -------------------------------------------------------------------

    def _run(self, prompt_ids: list[int], params: SamplingParams, gamma_max: int) -> Iterator[StreamChunk]:
        t0 = time.perf_counter()
        sampling = sampling_to_pb(params)
        fmt = self.proposal_format or ProposalFormat(kind=IDS_ONLY if params.greedy else DENSE)
        if params.method != REJECTION:
            fmt = ProposalFormat(kind=IDS_ONLY)  # greedy and typical acceptance never read q
        fmt_pb = proposal_format_to_pb(fmt)
        eos = set() if params.ignore_eos else set(self.verifier_info.eos_token_ids)
        stop_ids = set(params.stop_token_ids)
        result = GenerationResult(text="", token_ids=[], prompt_token_ids=list(prompt_ids), finish_reason="length",
                                  target_only=gamma_max == 0, logprobs=[] if params.logprobs is not None else None)
        prompt_length = len(prompt_ids)
        timeout = self.timeout_s
        # The committed list is the source of truth: a session lost on either side is
        # replaced by a new one that is re-prefilled from it (kv = [] -> truncate_to = 0).
        v_sid = self._open_verifier_session()
        committed = list(prompt_ids)
        verifier_kv: list[int] = []  # tokens the verifier's cache holds
        draft_link = _DrafterLink(max_draft_tokens=gamma_max)
        if gamma_max:
            self._connect_drafter(draft_link, result, check_info=False)
        emitted_text = ""
        drafter_context = self.drafter_info.max_context if self.drafter_info else 0
        try:
            finished = False
            while not finished:
                remaining = params.max_tokens - len(result.token_ids)
                # Never draft more than can be kept: the round emits up to gamma + 1 tokens.
                gamma = max(0, min(draft_link.max_draft_tokens, remaining - 1, drafter_context - len(committed)))
                drafts: list[int] = []
                proposal = None
                if gamma:
                    drafts, proposal = self._draft(draft_link, committed, gamma, sampling, fmt_pb, prompt_length,
                                                   result)
                ts = time.perf_counter()
                give_up = time.monotonic() + self.recovery_timeout_s  # bounds the retries of this round
                while True:
                    keep = _lcp(verifier_kv, committed, len(committed) - 1)
                    req = pb.VerifyRequest(session_id=v_sid, truncate_to=keep, append_token_ids=committed[keep:],
                                           draft_token_ids=drafts, sampling=sampling, prompt_length=prompt_length)
                    if proposal is not None:
                        req.proposal.CopyFrom(proposal)
                    try:
                        vresp = self.verifier.Verify(req, timeout=timeout)
                        break
                    except grpc.RpcError as exc:
                        if exc.code() not in _VERIFIER_LOST or time.monotonic() > give_up:
                            raise
                        self._close_quietly(self.verifier, v_sid)  # e.g. after a deadline it may still exist
                        # The drafts stay valid: they were proposed for `committed`, which is unchanged.
                        v_sid, verifier_kv = self._recover_verifier(exc, v_sid), []
                        result.verifier_recoveries += 1
                now = time.perf_counter()
                result.verify_time_s += now - ts
                out = list(vresp.output_token_ids)
                verifier_kv = committed + out[:-1]
                _check_kv("verifier", vresp.kv_length, len(verifier_kv))
                result.num_rounds += 1
                result.num_draft_tokens += len(drafts)
                result.num_accepted_tokens += vresp.num_accepted
                log.debug("round=%d drafts=%d accepted=%d", result.num_rounds, len(drafts), vresp.num_accepted)

                new: list[int] = []
                for i, tok in enumerate(out):
                    new.append(tok)
                    committed.append(tok)
                    result.token_ids.append(tok)
                    result.token_times_s.append(now - t0)
                    if result.logprobs is not None and i < len(vresp.logprobs):
                        lp = vresp.logprobs[i]
                        result.logprobs.append({"token_id": tok, "logprob": lp.logprob, "rank": lp.rank,
                                                "top_logprobs": dict(zip(lp.top_token_ids, lp.top_logprobs))})
                    if len(result.token_ids) < params.min_tokens:
                        continue  # vLLM checks no stop condition before min_tokens
                    if tok in eos or tok in stop_ids:
                        result.finish_reason, finished = "stop", True
                    elif len(result.token_ids) >= params.max_tokens:
                        result.finish_reason, finished = "length", True
                    if finished:
                        break
                text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
                stops = params.stop if len(result.token_ids) >= params.min_tokens else ()
                cut = _find_stop(text, stops, len(emitted_text))
                if cut is not None:
                    text, finished, result.finish_reason = text[:cut], True, "stop"
                if not result.ttft_s:
                    result.ttft_s = now - t0
                # Hold back an incomplete UTF-8 sequence until the next round completes it.
                stable = text if finished else text.rstrip("\ufffd")
                delta, emitted_text = stable[len(emitted_text):], stable
                if finished:
                    result.text = text
                    result.elapsed_s = time.perf_counter() - t0
                    yield StreamChunk(token_ids=new, text=delta, result=result)
                else:
                    yield StreamChunk(token_ids=new, text=delta)
        finally:
            self._close_quietly(self.verifier, v_sid)
            if draft_link.session_id:
                self._close_quietly(self.drafter, draft_link.session_id)

    # ---- fault tolerance ------------------------------------------------------------

    def _draft(self, link: "_DrafterLink", committed: list[int], gamma: int, sampling: pb.SamplingParams,
               fmt_pb: pb.ProposalFormat, prompt_length: int,
               result: GenerationResult) -> tuple[list[int], pb.Proposal | None]:
        """This round's drafts and their proposal, or none while the drafter is unreachable:
        the round is then a target-only step, which leaves the output distribution as it is."""
        if link.session_id is None and (time.monotonic() < link.retry_at or not self._connect_drafter(link, result)):
            result.drafter_fallback_rounds += 1
            return [], None
        keep = _lcp(link.kv, committed, len(committed) - 1)
        ts = time.perf_counter()
        try:
            resp = self.drafter.Draft(
                pb.DraftRequest(session_id=link.session_id, truncate_to=keep, append_token_ids=committed[keep:],
                                num_draft_tokens=min(gamma, link.max_draft_tokens), sampling=sampling,
                                proposal_format=fmt_pb, prompt_length=prompt_length),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            if exc.code() not in _DRAFTER_LOST:
                raise
            log.warning("drafter lost session=%s code=%s details=%r; target-only rounds until it is back",
                        link.session_id, exc.code().name, exc.details())
            result.drafter_failures += 1
            result.drafter_fallback_rounds += 1
            # NOT_FOUND (restarted, evicted, expired): the drafter is there, reconnect next round.
            link.lost(immediate=exc.code() == grpc.StatusCode.NOT_FOUND)
            return [], None
        finally:
            result.draft_time_s += time.perf_counter() - ts
        drafts = list(resp.draft_token_ids)
        result.proposal_bytes += len(resp.proposal.probs) + len(resp.proposal.token_ids)
        link.kv = committed + drafts[:-1]
        _check_kv("drafter", resp.kv_length, len(link.kv))
        return drafts, resp.proposal

    def _connect_drafter(self, link: "_DrafterLink", result: GenerationResult, check_info: bool = True) -> bool:
        """Open a drafter session (after a failure: re-check the drafter, whose next Draft
        re-prefills all committed tokens). False, with the next try scheduled, if it fails."""
        short = min(self.timeout_s, 5.0)
        try:
            if check_info:
                info = model_info_from_pb(self.drafter.GetModelInfo(pb.ModelInfoRequest(), timeout=short))
                check_compatible(info, self.verifier_info)
                link.max_draft_tokens = min(link.max_draft_tokens, info.max_draft_tokens)
            link.session_id = self.drafter.OpenSession(pb.OpenSessionRequest(), timeout=short).session_id
        except grpc.RpcError as exc:
            if exc.code() not in _DRAFTER_LOST:
                raise
            log.info("drafter unavailable code=%s; retry in %.2f s", exc.code().name, link.backoff_s)
            result.drafter_failures += 1
            link.lost(immediate=False)
            return False
        except IncompatibleModels as exc:
            log.error("the restarted drafter no longer fits the verifier (%s); target-only from here", exc)
            link.lost(immediate=False)
            link.retry_at = float("inf")
            return False
        if check_info:
            log.info("drafter back session=%s; speculation resumes", link.session_id)
        link.kv, link.backoff_s = [], _BACKOFF_MIN_S
        return True

    def _open_verifier_session(self) -> str:
        try:
            return self.verifier.OpenSession(pb.OpenSessionRequest(), timeout=self.timeout_s).session_id
        except grpc.RpcError as exc:
            if exc.code() not in _VERIFIER_LOST:
                raise
            return self._recover_verifier(exc, None)

    def _recover_verifier(self, error: grpc.RpcError, lost_session: str | None) -> str:
        """A new verifier session once the verifier answers again (retrying with backoff for
        up to recovery_timeout_s, then re-raising `error`). The caller re-prefills it."""
        log.warning("verifier lost session=%s code=%s details=%r; reconnecting for up to %.0f s",
                    lost_session, error.code().name, error.details(), self.recovery_timeout_s)
        deadline = time.monotonic() + self.recovery_timeout_s
        delay = 0.0 if error.code() == grpc.StatusCode.NOT_FOUND else _BACKOFF_MIN_S
        short = min(self.timeout_s, 5.0)
        while True:
            time.sleep(delay)
            try:
                info = model_info_from_pb(self.verifier.GetModelInfo(pb.ModelInfoRequest(), timeout=short))
                if (info.model, info.vocab_size, info.tokenizer_fingerprint) != (
                        self.verifier_info.model, self.verifier_info.vocab_size,
                        self.verifier_info.tokenizer_fingerprint):
                    raise IncompatibleModels(f"the verifier came back as {info.model}, not {self.verifier_info.model}")
                session_id = self.verifier.OpenSession(pb.OpenSessionRequest(), timeout=short).session_id
            except grpc.RpcError as again:
                if again.code() not in _VERIFIER_LOST:
                    raise
                delay = min(max(2 * delay, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
                if time.monotonic() + delay > deadline:
                    raise error from again
                continue
            log.info("verifier back session=%s; re-prefilling", session_id)
            return session_id

    def _close_quietly(self, stub, session_id: str) -> None:
        try:
            stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=min(self.timeout_s, 5.0))
        except grpc.RpcError as exc:  # the session expires on the server anyway
            # After a restart or an eviction the session is simply gone: nothing to report.
            expected = exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
            log.log(logging.DEBUG if expected else logging.WARNING, "CloseSession %s failed: %s", session_id,
                    exc.code())


# Status codes after which a side's session is gone or its server unreachable. Anything
# else (INVALID_ARGUMENT, ...) is a wrong request and propagates. The drafter also falls
# back when it is full (RESOURCE_EXHAUSTED): drafts are optional, the verifier is not.
_DRAFTER_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED})
_VERIFIER_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED})
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.25, 4.0


@dataclass
class _DrafterLink:
    """The drafter side of one generation: its session (None while the drafter is
    unreachable), the tokens its KV cache holds, and when to try it again."""

    max_draft_tokens: int
    session_id: str | None = None
    kv: list[int] = field(default_factory=list)
    retry_at: float = 0.0  # time.monotonic() of the next reconnect
    backoff_s: float = _BACKOFF_MIN_S

    def lost(self, immediate: bool) -> None:
        self.session_id, self.kv = None, []
        self.retry_at = time.monotonic() + (0.0 if immediate else self.backoff_s)
        if not immediate:
            self.backoff_s = min(2 * self.backoff_s, _BACKOFF_MAX_S)


def _check_kv(role: str, reported: int, expected: int) -> None:
    if reported != expected:
        raise RuntimeError(f"{role} reports KV length {reported}, the client expected {expected}")


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index where the earliest stop string begins, searching from just before `start`."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def check_compatible(drafter: ModelInfo, verifier: ModelInfo) -> None:
    """Refuse a pair whose token ids would not mean the same text."""
    if drafter.tokenizer_fingerprint != verifier.tokenizer_fingerprint:
        raise IncompatibleModels(
            f"drafter {drafter.model} and verifier {verifier.model} use different tokenizers "
            f"(fingerprints {drafter.tokenizer_fingerprint[:12]} vs {verifier.tokenizer_fingerprint[:12]}); "
            "speculative decoding needs one vocabulary"
        )
    if drafter.vocab_size != verifier.vocab_size:
        raise IncompatibleModels(
            f"drafter vocab_size {drafter.vocab_size} differs from verifier vocab_size {verifier.vocab_size}"
        )
