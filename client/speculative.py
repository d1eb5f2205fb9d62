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
from specdec.sampling import SamplingParams
from specdec.serving import ModelInfo
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS, model_info_from_pb, proposal_format_to_pb, sampling_to_pb

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
    ) -> None:
        self.timeout_s = timeout_s
        self.num_speculative_tokens = num_speculative_tokens
        self.proposal_format = proposal_format
        self._channels = [grpc.insecure_channel(verifier, options=CHANNEL_OPTIONS)]
        self.verifier = pb_grpc.VerifierStub(self._channels[0])
        self.verifier_info = model_info_from_pb(self.verifier.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout_s))
        self.drafter = None
        self.drafter_info: ModelInfo | None = None
        if drafter:
            self._channels.append(grpc.insecure_channel(drafter, options=CHANNEL_OPTIONS))
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
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)

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
            gamma_max = min(gamma_max, self.drafter_info.max_draft_tokens, self.verifier_info.max_draft_tokens)
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
        fmt_pb = proposal_format_to_pb(fmt)
        eos = set() if params.ignore_eos else set(self.verifier_info.eos_token_ids)
        stop_ids = set(params.stop_token_ids)
        result = GenerationResult(text="", token_ids=[], prompt_token_ids=list(prompt_ids), finish_reason="length",
                                  target_only=gamma_max == 0)
        timeout = self.timeout_s
        v_sid = self.verifier.OpenSession(pb.OpenSessionRequest(), timeout=timeout).session_id
        d_sid = self.drafter.OpenSession(pb.OpenSessionRequest(), timeout=timeout).session_id if gamma_max else None
        committed = list(prompt_ids)
        drafter_kv: list[int] = []  # tokens the drafter's cache holds
        verifier_kv: list[int] = []
        emitted_text = ""
        drafter_context = self.drafter_info.max_context if self.drafter_info else 0
        try:
            finished = False
            while not finished:
                remaining = params.max_tokens - len(result.token_ids)
                # Never draft more than can be kept: the round emits up to gamma + 1 tokens.
                gamma = max(0, min(gamma_max, remaining - 1, drafter_context - len(committed)))
                drafts: list[int] = []
                proposal = None
                if gamma:
                    keep = _lcp(drafter_kv, committed, len(committed) - 1)
                    ts = time.perf_counter()
                    resp = self.drafter.Draft(
                        pb.DraftRequest(session_id=d_sid, truncate_to=keep, append_token_ids=committed[keep:],
                                        num_draft_tokens=gamma, sampling=sampling, proposal_format=fmt_pb),
                        timeout=timeout,
                    )
                    result.draft_time_s += time.perf_counter() - ts
                    drafts = list(resp.draft_token_ids)
                    proposal = resp.proposal
                    drafter_kv = committed + drafts[:-1]
                    _check_kv("drafter", resp.kv_length, len(drafter_kv))
                keep = _lcp(verifier_kv, committed, len(committed) - 1)
                ts = time.perf_counter()
                req = pb.VerifyRequest(session_id=v_sid, truncate_to=keep, append_token_ids=committed[keep:],
                                       draft_token_ids=drafts, sampling=sampling)
                if proposal is not None:
                    req.proposal.CopyFrom(proposal)
                vresp = self.verifier.Verify(req, timeout=timeout)
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
                for tok in out:
                    new.append(tok)
                    committed.append(tok)
                    result.token_ids.append(tok)
                    result.token_times_s.append(now - t0)
                    if tok in eos or tok in stop_ids:
                        result.finish_reason, finished = "stop", True
                    elif len(result.token_ids) >= params.max_tokens:
                        result.finish_reason, finished = "length", True
                    if finished:
                        break
                text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
                cut = _find_stop(text, params.stop, len(emitted_text))
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
            if d_sid:
                self._close_quietly(self.drafter, d_sid)

    def _close_quietly(self, stub, session_id: str) -> None:
        try:
            stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=min(self.timeout_s, 5.0))
        except grpc.RpcError as exc:  # the session expires on the server anyway
            log.warning("CloseSession %s failed: %s", session_id, exc.code())


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
