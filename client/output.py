"""What a generation returns: its result, its stream chunks, and the output processor that
turns each round's verified tokens into them (stop conditions, incremental detokenization)."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from specdec.sampling import SamplingParams


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop string or stop token) or "length"
    # vLLM's: the stop string or stop token id that ended the generation; None for EOS and length
    stop_reason: str | int | None = None
    num_rounds: int = 0
    num_draft_tokens: int = 0  # proposed
    num_accepted_tokens: int = 0  # accepted drafts
    elapsed_s: float = 0.0
    ttft_s: float = 0.0
    draft_time_s: float = 0.0  # time spent in Draft calls (client side)
    verify_time_s: float = 0.0  # time spent in Verify calls (client side)
    # Engine time behind those calls, as the services reported it (EngineLoad): the device time
    # and the wall time of the verifier steps that served its rounds, and the drafter's device
    # time of the draft steps it ran for them. verify_time_s - verify_device_s is the host path.
    verify_device_s: float = 0.0
    verify_step_s: float = 0.0
    draft_device_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # arrival time of each generated token, from start
    target_only: bool = False
    # One entry per generated token when SamplingParams.logprobs is set: its logprob under
    # the target's processed distribution, its rank, and the top-N {token id: logprob}.
    logprobs: list[dict] | None = None
    # SamplingParams.prompt_logprobs (vLLM's): one per prompt token, the same entries under the
    # target's raw distribution; None for the first token, which nothing precedes.
    prompt_logprobs: list[dict | None] | None = None
    proposal_bytes: int = 0  # the proposals' payload (probs + token_ids) the drafter sent, summed over rounds
    # Speculation cache (fanout > 0): drafts the drafter had pre-drafted during the previous
    # verify, and the rounds whose drafts all came from there (no drafter forward waited for).
    cached_draft_tokens: int = 0
    speculation_hits: int = 0
    gamma_per_round: list[int] = field(default_factory=list)  # drafts of each round (0: a target-only round)
    num_speculative_rounds: int = 0  # rounds that verified at least one draft
    # Faults survived. Fallback rounds ran without drafts because no drafter was reachable
    # (the output distribution is the same, only slower); every recovery re-created a
    # verifier session and re-prefilled it from the committed tokens. A failover is a lost
    # session re-opened (and re-prefilled) on another server of the pool.
    drafter_failures: int = 0  # failed Draft calls and failed attempts to open a drafter session
    drafter_fallback_rounds: int = 0
    verifier_recoveries: int = 0
    drafter_failovers: int = 0
    verifier_failovers: int = 0
    # The servers this generation had its sessions on, in order (a new entry per move).
    drafter_addresses: list[str] = field(default_factory=list)
    verifier_addresses: list[str] = field(default_factory=list)

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


def json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: a token that top_k / top_p / min_p filtered out has logprob
    -inf under the processed distribution, which strict JSON (jq, JavaScript) has no word for;
    vLLM's server writes it -9999.0, and so do the gateway and `generate --json`."""
    return max(logprob, -9999.0)


@dataclass(frozen=True)
class StreamChunk:
    token_ids: list[int]  # tokens committed this round
    text: str  # new text since the previous chunk
    result: GenerationResult | None = None  # set on the last chunk
    logprobs: list[dict] | None = None  # this round's entries of GenerationResult.logprobs (SamplingParams.logprobs)
    prompt_logprobs: list[dict | None] | None = None  # GenerationResult.prompt_logprobs, on the first chunk


class OutputProcessor:
    """One generation's output side. Each round's verified tokens are committed one by one
    until a stop condition holds, in vLLM's order: none before min_tokens, then EOS (unless
    ignore_eos) or a stop token id, then max_tokens; stop strings are searched in the text.
    The text streams incrementally: an incomplete UTF-8 sequence, and a tail that could be
    the start of a stop string, are held back until a later round settles them.

    Detokenization is incremental too, as vLLM's: each round decodes only a window from the
    tokens before the last settled ones (`_prefix_offset`) and keeps the part past their text,
    so a round costs O(its tokens), not O(all tokens so far)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: Sequence[int], result: GenerationResult,
                 t0: float) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.result = result
        self.finished = False
        self._eos = set() if params.ignore_eos else set(eos_token_ids)
        self._stop_ids = set(params.stop_token_ids) | self._eos
        self._t0 = t0  # perf_counter at the generation's start
        self._emitted = ""  # text already streamed
        self._text = ""  # decoded text of token_ids[:_read_offset]
        self._prefix_offset = 0  # the decode window starts here: context for the tokens after _read_offset
        self._read_offset = 0
        self._stop_floor: int | None = None  # see _stop_search_start

    def commit(self, token_ids: Sequence[int], logprobs: Sequence[dict] | None, now: float) -> StreamChunk:
        """Commit a round's tokens (the accepted drafts, then the bonus or recovered token) and
        return the round's chunk; the last one carries the result. logprobs: one entry per
        token (when SamplingParams.logprobs is set); now: perf_counter when the round answered."""
        result, params = self.result, self.params
        new: list[int] = []
        logprobs_from = len(result.logprobs) if result.logprobs is not None else 0
        for i, tok in enumerate(token_ids):
            new.append(tok)
            result.token_ids.append(tok)
            result.token_times_s.append(now - self._t0)
            if result.logprobs is not None and logprobs is not None and i < len(logprobs):
                result.logprobs.append(logprobs[i])
            if len(result.token_ids) < params.min_tokens:
                continue
            if tok in self._stop_ids:
                result.finish_reason, self.finished = "stop", True
                # EOS first, as vLLM's check_stop: None for it even if stop_token_ids lists it
                result.stop_reason = None if tok in self._eos else tok
            elif len(result.token_ids) >= params.max_tokens:
                result.finish_reason, self.finished = "length", True
            if self.finished:
                break
        if not result.ttft_s:
            result.ttft_s = now - self._t0
        if self.finished and result.finish_reason == "stop" and not params.include_stop_str_in_output:
            # A stop token id (or EOS) ends the generation without its text, as vLLM v1's
            # detokenizer: the id stays in token_ids, its text only with include_stop_str_in_output.
            text = self._decode(result.token_ids[:-1])
        else:
            text = self._decode(result.token_ids)
        stops = params.stop if len(result.token_ids) > params.min_tokens else ()
        found = find_stop(text, stops, self._stop_search_start()) if stops else None
        if found is not None:
            text, (cut, stop) = self._end_at_stop(new, text, found)
            end = cut + len(stop) if params.include_stop_str_in_output else cut
            text, self.finished, result.finish_reason, result.stop_reason = text[:end], True, "stop", stop
        # The bytes of an incomplete character (U+FFFD) are never shown: held back while the
        # generation runs, dropped at its end where max_tokens cut one (as vLLM's detokenizer).
        # Before a stop string they are bytes no continuation completes: invalid ones, kept.
        stable = text = text if found is not None else text.rstrip("\ufffd")
        if not self.finished and params.stop:  # before min_tokens too: a stop string may end past it
            hold = max(map(len, params.stop)) - 1
            stable = stable[:max(len(self._emitted), len(stable) - hold)]
        delta, self._emitted = stable[len(self._emitted):], stable
        round_logprobs = result.logprobs[logprobs_from:] if result.logprobs is not None else None
        if not self.finished:
            return StreamChunk(token_ids=new, text=delta, logprobs=round_logprobs)
        result.text = text
        result.elapsed_s = time.perf_counter() - self._t0
        return StreamChunk(token_ids=new, text=delta, result=result, logprobs=round_logprobs)


    def _stop_search_start(self) -> int:
        """Where stop strings may end from (exclusive): after the text already streamed, and
        after the text of the first min_tokens tokens, so a stop string counts when a token
        past the min_tokens-th completes it (vLLM V1's detokenizer, vllm#22014), however many
        tokens each round brought."""
        if self._stop_floor is None:
            floor_ids = self.result.token_ids[:self.params.min_tokens]
            # Without the U+FFFD of a character those tokens end inside: a token past
            # min_tokens completes that character, so a stop string may end with it.
            floor_text = self.tokenizer.decode(floor_ids, skip_special_tokens=True) if floor_ids else ""
            self._stop_floor = len(floor_text.rstrip("\ufffd"))
        return max(len(self._emitted), self._stop_floor)

    def _end_at_stop(self, new: list[int], text: str, found: tuple[int, str]) -> tuple[str, tuple[int, str]]:
        """A stop string ends the generation at the token that completes it, as one token a
        round would: the round's tokens after that one are dropped (from `new` too), so token
        ids, usage and logprobs do not depend on how many tokens a round verified. Returns the
        text of the tokens kept, and where the stop string starts in it and which one it is."""
        result, params = self.result, self.params
        base = len(result.token_ids) - len(new)
        for keep in range(max(1, params.min_tokens + 1 - base), len(new)):
            head = self.tokenizer.decode(result.token_ids[:base + keep], skip_special_tokens=True)
            if (at := find_stop(head, params.stop, self._stop_search_start())) is not None:
                del new[keep:], result.token_ids[base + keep:], result.token_times_s[base + keep:]
                if result.logprobs is not None:
                    del result.logprobs[base + keep:]
                return head, at
        return text, found

    def _decode(self, ids: list[int]) -> str:
        """The text of `ids` (all tokens so far): the settled text, plus the new tokens' text,
        which ends in U+FFFD while they end inside a UTF-8 sequence (then they stay unsettled)."""
        decode = self.tokenizer.decode
        settled = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        window = decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if window.startswith(settled):
            # The window repeats the settled tokens' text (a leading-space rule trims both alike):
            # the new text is what follows it.
            new, text = window[len(settled):], self._text + window[len(settled):]
        else:  # the new tokens change how the settled ones read (a clean-up rule): decode it all
            text = decode(ids, skip_special_tokens=True)
            new = text[len(self._text):]
        if new and not new.endswith("\ufffd"):
            self._text = text
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return text


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string that ends past `start`; at one index,
    the first listed. The stop is the one found: another listed stop may begin at the same
    index and end before `start` (before min_tokens), which does not count."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenBytes:
    """A token's own bytes, OpenAI's logprobs `bytes`: what a client joins to rebuild the text.

    Decoded alone, a token that holds part of a UTF-8 character is U+FFFD, whose bytes say
    nothing of it (`日` is two tokens of the embedded tokenizer, each "\ufffd" alone). For a
    byte-level BPE tokenizer (GPT-2's, Llama 3's, SmolLM's, Qwen's) a vocabulary entry spells
    its bytes in the alphabet above, and a SentencePiece byte-fallback token names its byte;
    any other token gives the UTF-8 of its text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        state = decoder.__getstate__() if decoder is not None else b""
        self._alphabet = _byte_alphabet() if b'"type":"ByteLevel"' in state else None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if (cached := self._cache.get(token_id)) is not None:
            return cached
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._alphabet is not None and piece and all(c in self._alphabet for c in piece):
            out = bytes(self._alphabet[c] for c in piece)
        elif piece and (m := _BYTE_FALLBACK.fullmatch(piece)):
            out = bytes([int(m.group(1), 16)])
        else:
            out = self.tokenizer.decode([token_id]).encode("utf-8")
        self._cache[token_id] = out
        return out
