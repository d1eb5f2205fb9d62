"""SamplingParams (vLLM's names and meanings), logits processing, and seeded noise.

Drafter and verifier process logits with the same function, so the proposal q and the
target p are distributions of the same kind: losslessness is with respect to the
target's *processed* distribution.

Randomness scheme (reproducible, independent of batch composition and device): every
random draw of a request is a counter-based uniform `hash(seed, stream, position, slot)`
(`counter_uniforms`, splitmix64 over int64 tensors), where `position` is the absolute
index of the token being decided in the session's sequence, `stream` separates the
drafter's draws from the verifier's, and `slot` 0 / 1 is the acceptance draw / the
inverse-CDF draw that picks a token. A position is decided exactly once by the verifier
(later rounds start after it), so no draw is reused; the drafter may re-draft a position
after a rejection, but the earlier draft at that position never influenced any emitted
token. Two uniforms per position replace V exponentials per position (the previous
exponential race), so a batch's draws cost a few integer ops and no host sync.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from specdec.errors import InvalidArgument, invalid_text

STREAM_DRAFT = 1
STREAM_VERIFY = 2
_FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1  # top_k, min_tokens and stop token ids travel as int32
# Entries of stop_token_ids, allowed_token_ids or logit_bias. Every round re-sends a request's
# parameters and both services re-check them: a million stop ids (7 MB) made each round of that
# request cost a second and held gigabytes on the services, stalling every other request.
# Longer than the largest vocabularies' ids worth naming; a list of every id is no filter.
MAX_TOKEN_ID_LIST = 65_536


# Penalised logits saturate here: an extreme repetition_penalty (10 / 1e-39) overflowed float32 to
# inf, whose softmax is NaN. Still dominant (or vanishing) after the smallest temperature.
LOGIT_BOUND = 1e20
_MASK64 = (1 << 64) - 1


REJECTION, GREEDY, TYPICAL = "rejection", "greedy", "typical"
ACCEPTANCE_METHODS = (REJECTION, GREEDY, TYPICAL)
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a smaller positive temperature is raised to it


def float32(value: float) -> float:
    """`value` as the wire's 32-bit float carries it (1e-50 arrives as 0.0)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _as_sent(value: float) -> str:
    sent = float32(value)
    return "" if sent == value or sent != 0.0 else " (0 as the 32-bit float it travels as)"


def check_id_list_length(name: str, n: int) -> None:
    if n > MAX_TOKEN_ID_LIST:
        raise InvalidArgument(name, f"at most {MAX_TOKEN_ID_LIST} entries, got {n}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters with vLLM's names, defaults and meanings.

    temperature 0 selects greedy decoding (a positive one below 0.01 is raised to 0.01, as vLLM
    does); top_k 0 (or -1, as vLLM) and top_p 1 disable those filters. max_tokens / stop / include_stop_str_in_output are enforced by the client;
    the others travel to both services, which apply the same processors (`process_logits`).

    acceptance_method: "rejection" (default; lossless speculative sampling), "greedy"
    (argmax matching; requires temperature 0, which selects it anyway), or "typical"
    (vLLM's TypicalAcceptanceSampler, Medusa §3.3.1: accept a draft x when
    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))); NOT lossless: it trades
    exactness for acceptance).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context (the verifier's max_context less the prompt)
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt tokens under the raw model (verifier only)
    acceptance_method: str = REJECTION
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # vLLM's defaults for these are None: code that forwards its keyword arguments sends them.
        for name in ("stop", "stop_token_ids", "logit_bias"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        # Accept lists from callers but keep the dataclass hashable and immutable.
        try:
            object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        except TypeError:
            raise InvalidArgument("stop", f"must be a string or a sequence of strings, got {self.stop!r}") from None
        try:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        except TypeError:
            raise InvalidArgument("stop_token_ids", f"must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            try:
                object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            except TypeError:
                raise InvalidArgument("allowed_token_ids", "must be a sequence of token ids, got "
                                                           f"{self.allowed_token_ids!r}") from None
        self.validate()
        for name in ("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs"):  # numpy's ints -> int
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in _FLOAT_FIELDS:  # numpy's floats -> float
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in _BOOL_FIELDS:  # numpy's bools -> bool
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(map(int, self.stop_token_ids)))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(map(int, self.allowed_token_ids)))))
        if self.top_k == -1:  # vLLM's "off", stored as ours (0) so equal settings compare equal
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and self.seed < 0:  # vLLM takes int64 seeds: kept as their uint64 bit pattern
            object.__setattr__(self, "seed", self.seed & _MASK64)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM: logits / 1e-39 overflow to ±inf and the softmax to NaN, whose inverse CDF
            # sampled id V (past the vocabulary) on both services.
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_token_filters(self) -> bool:
        """logit_bias or allowed_token_ids: processing that changes the raw logits of given ids."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def has_own_processors(self) -> bool:
        """min_tokens, penalties or token filters: processing set by the request's own tokens or
        lists, so its rows are not processed in a stack with other requests' that share
        temperature, top_k, top_p and min_p."""
        return bool(self.min_tokens) or self.has_penalties or self.has_token_filters

    def validate(self) -> None:
        def finite(name: str) -> float:
            value = getattr(self, name)
            if not _finite_float32(value):
                raise InvalidArgument(name, f"must be a finite number, got {value!r}")
            return value

        def integer(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # 1.5, "3", True: a caller's slip
                raise InvalidArgument(name, f"must be an integer, got {value!r}")

        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logit_bias", self.logit_bias)):
            check_id_list_length(name, len(ids))
        for name in ("top_k", "min_tokens"):
            integer(name, getattr(self, name))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), (bool, np.bool_)):  # "no" would read as true
                raise InvalidArgument(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, getattr(self, name))
        for t in self.stop_token_ids:
            integer("stop_token_ids", t)
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidArgument("stop", f"stop strings must be strings, got {self.stop!r}")
        for s in self.stop:  # a lone surrogate can never be generated: a stop that never matches
            if (where := invalid_text(s)) is not None:
                raise InvalidArgument("stop", f"a stop string is not valid Unicode text: {where}")
        if finite("temperature") < 0:
            raise InvalidArgument("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if not -1 <= self.top_k <= INT32_MAX:
            raise InvalidArgument("top_k", f"must be in [-1, {INT32_MAX}] (-1 or 0 disables top-k), got {self.top_k}")
        if not (0.0 < float32(finite("top_p")) <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1] (1 disables top-p), got {self.top_p}{_as_sent(self.top_p)}")
        if not (0.0 <= finite("min_p") <= 1.0):
            raise InvalidArgument("min_p", f"must be in [0, 1] (0 disables min-p), got {self.min_p}")
        if self.seed is not None and not (-2**63 <= self.seed <= _MASK64):
            raise InvalidArgument("seed", f"must be a 64-bit integer (signed or unsigned), got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1 (or None: up to the context), got {self.max_tokens}")
        if self.max_tokens is None and not 0 <= self.min_tokens <= INT32_MAX:
            raise InvalidArgument("min_tokens", f"must be in [0, {INT32_MAX}], got {self.min_tokens}")
        if self.max_tokens is not None and not 0 <= self.min_tokens <= min(self.max_tokens, INT32_MAX):
            raise InvalidArgument("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must be non-empty")
        if (bad := next((t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX), None)) is not None:
            raise InvalidArgument("stop_token_ids", f"token ids must be in [0, {INT32_MAX}], got {bad}")
        for t, bias in self.logit_bias:
            integer("logit_bias", t)
            if not 0 <= t <= INT32_MAX:
                raise InvalidArgument("logit_bias", f"token ids must be in [0, {INT32_MAX}], got {t}")
            if not _finite_float32(bias):
                raise InvalidArgument("logit_bias", f"the bias of token {t} must be a finite number, got {bias!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidArgument("allowed_token_ids", "must name at least one token (None allows every token)")
            for t in self.allowed_token_ids:
                integer("allowed_token_ids", t)
                if not 0 <= t <= INT32_MAX:
                    raise InvalidArgument("allowed_token_ids", f"token ids must be in [0, {INT32_MAX}], got {t}")
        if float32(finite("repetition_penalty")) <= 0:
            raise InvalidArgument("repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty}"
                                                        f"{_as_sent(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= finite(name) <= 2.0:
                raise InvalidArgument(name, f"must be in [-2, 2] (0 disables it), got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                raise InvalidArgument(name, f"must be in [0, {MAX_LOGPROBS}], got {getattr(self, name)}")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise InvalidArgument(
                "acceptance_method", f"must be one of {', '.join(ACCEPTANCE_METHODS)}, got {self.acceptance_method!r}"
            )
        if self.acceptance_method == GREEDY and not self.greedy:
            raise InvalidArgument("acceptance_method", "greedy matching needs temperature 0")
        if not 0.0 <= finite("posterior_threshold") <= 1.0:
            raise InvalidArgument("posterior_threshold", f"must be in [0, 1], got {self.posterior_threshold}")
        if finite("posterior_alpha") < 0.0:
            raise InvalidArgument("posterior_alpha", f"must be >= 0, got {self.posterior_alpha}")

    @property
    def method(self) -> str:
        """The acceptance rule the verifier applies (temperature 0 always matches greedily)."""
        return GREEDY if self.greedy else self.acceptance_method

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TokenContext:
    """What the position-dependent processors (penalties, min_tokens) need for one request.

    `prefix` is the sequence before the first scored position (prompt + outputs so far);
    position i of a block of N scored positions also sees `block[:i]` (the drafts before it).
    """

    prefix: Sequence[int]
    prompt_length: int
    eos_token_ids: tuple[int, ...] = ()


def check_min_tokens(params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int],
                     field_prefix: str = "") -> None:
    """min_tokens masks EOS and the stop ids before its count: some token must be left, or
    every row before it is -inf everywhere (a NaN distribution, which sampled id V). The
    verifier checks it, and the client before its first call."""
    if not params.min_tokens:
        return
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    allowed = {t for t in params.allowed_token_ids or () if t < vocab_size}
    if allowed and allowed <= banned:
        raise InvalidArgument(f"{field_prefix}allowed_token_ids", "min_tokens masks every allowed token (each is EOS "
                                                                  "or a stop token id)")
    if len({t for t in banned if 0 <= t < vocab_size}) >= vocab_size:
        raise InvalidArgument(f"{field_prefix}stop_token_ids", "min_tokens would mask every token of the vocabulary "
                                                               "(EOS and the stop token ids cover it)")


def _finite_float32(value) -> bool:
    """A real number (not a bool) that the wire's 32-bit floats carry as itself: 1e308 would
    arrive as inf."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
            and abs(float(value)) <= _FLOAT32_MAX)


_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "posterior_threshold", "posterior_alpha")


def _bias_pairs(value) -> tuple:
    """logit_bias as given ({id: bias} or (id, bias) pairs) -> pairs sorted by id, one per id."""
    try:
        pairs = list(value.items()) if isinstance(value, dict) else [tuple(p) for p in value]
    except TypeError:
        raise InvalidArgument("logit_bias", f"must map token ids to biases, got {value!r}") from None
    if any(len(p) != 2 for p in pairs):
        raise InvalidArgument("logit_bias", f"must map token ids to biases, got {value!r}")
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("logit_bias", "names a token id twice")
    try:
        return tuple(sorted(pairs))
    except TypeError:  # ids of mixed types: validate() names them
        return tuple(pairs)


def apply_token_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """allowed_token_ids, then logit_bias, on raw logits [N, V] (a new tensor; the input is
    never written). Ids past V are skipped: a drafter whose head is smaller than the target's
    proposes none of them anyway, and the verifier refuses them (`check_request`). An allowed
    set with no id below V leaves the logits unmasked (such a drafter's drafts are all
    rejected; the verifier's processing, which is the one that counts, masks)."""
    vocab = logits.shape[-1]
    allowed = [t for t in params.allowed_token_ids or () if t < vocab]
    if allowed:
        mask = torch.full((vocab,), -math.inf, dtype=logits.dtype, device=logits.device)
        mask[torch.tensor(allowed, device=logits.device)] = 0.0
        logits = logits + mask
    bias = [(t, b) for t, b in params.logit_bias if t < vocab]
    if bias:
        ids = torch.tensor([t for t, _ in bias], device=logits.device)
        logits = logits.index_add(-1, ids, torch.tensor([b for _, b in bias], dtype=logits.dtype,
                                                        device=logits.device).expand(*logits.shape[:-1], -1))
        # Saturate as the penalties do: a bias near float32's maximum is valid, and divided by a
        # temperature below 1 it overflowed to inf, whose softmax is NaN (the request failed).
        logits = torch.where(logits == -math.inf, logits, logits.clamp(-LOGIT_BOUND, LOGIT_BOUND))
    return logits


def apply_penalties_and_min_tokens(
    logits: torch.Tensor,  # [N, V] float32, raw logits of N consecutive positions
    params: SamplingParams,
    ctx: TokenContext,
    block: Sequence[int],  # tokens at positions 0..N-2 of the block (the drafts), len >= N - 1
) -> torch.Tensor:
    """vLLM's non-argmax-invariant processors: min_tokens mask, then repetition /
    frequency / presence penalties, each position using exactly the tokens before it."""
    n, vocab = logits.shape
    first = len(ctx.prefix)  # absolute position of row 0
    if params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(ctx.eos_token_ids))
        banned = [t for t in banned if 0 <= t < vocab]
        # Row i decides output number (first + i - prompt_length); mask while it is < min_tokens.
        rows = [i for i in range(n) if first + i - ctx.prompt_length < params.min_tokens]
        if rows and banned:
            logits = logits.clone()
            logits[torch.tensor(rows)[:, None], torch.tensor(banned)[None, :]] = -math.inf
    if not params.has_penalties:
        return logits
    device = logits.device
    prompt = torch.as_tensor(list(ctx.prefix[: ctx.prompt_length]), dtype=torch.long, device=device)
    seen_output = list(ctx.prefix[ctx.prompt_length :])
    later = torch.as_tensor(list(block[: n - 1]), dtype=torch.long, device=device)
    # output_counts[i] = counts of output tokens before row i: [N, V]
    base = torch.zeros(vocab, dtype=torch.float32, device=device)
    if seen_output:
        base.index_add_(0, torch.as_tensor(seen_output, device=device), torch.ones(len(seen_output), device=device))
    steps = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    if n > 1:
        steps[1:].scatter_(1, later[:, None], 1.0)
    output_counts = base[None, :] + steps.cumsum(dim=0)
    output_mask = output_counts > 0
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = output_mask.clone()
        if prompt.numel():
            seen[:, prompt] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        penalized = torch.where(logits == -math.inf, logits, penalized.clamp(-LOGIT_BOUND, LOGIT_BOUND))  # masks stay
        logits = torch.where(seen, penalized, logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * output_counts
    if params.presence_penalty:
        logits -= params.presence_penalty * output_mask.float()
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed sampling distribution for one request (after penalties / min_tokens).

    logits: [N, V] (any float dtype) -> probs: [N, V] float32, rows sum to 1.
    Order as in vLLM v1: temperature, min-p, top-k, top-p. Not for greedy requests.
    """
    if params.greedy:
        raise ValueError("greedy requests take the argmax path, not a distribution")
    logits = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, -math.inf)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def process_logits(
    logits: torch.Tensor,  # [N, V] raw logits of N consecutive positions of one request
    params: SamplingParams,
    ctx: TokenContext | None = None,
    block: Sequence[int] = (),
) -> torch.Tensor:
    """The full processor chain both services share -> [N, V] float32.

    Random requests get the processed probabilities p. Greedy requests get
    softmax(penalized logits), whose argmax is the greedy token and whose log is what
    `logprobs` reports for them (temperature 0 has no distribution of its own).
    """
    logits = logits.float()
    if params.has_token_filters:
        logits = apply_token_filters(logits, params)
    if ctx is not None:
        logits = apply_penalties_and_min_tokens(logits, params, ctx, block)
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    return logits_to_probs(logits, params)


def top_logprobs(
    probs: torch.Tensor,  # [N, V] processed distribution at each emitted position
    token_ids: Sequence[int],  # [N] the emitted tokens
    num: int,
) -> list[tuple[float, int, list[int], list[float]]]:
    """(logprob, rank, top ids, top logprobs) of each emitted token; rank 1 = most likely."""
    return ranked_logprobs(torch.log(probs), token_ids, num)  # log 0 = -inf for filtered tokens, as vLLM's


def ranked_logprobs(
    logp: torch.Tensor,  # [N, V] log-probabilities at each position
    token_ids: Sequence[int],  # [N] the token taken at each position
    num: int,
) -> list[tuple[float, int, list[int], list[float]]]:
    """(logprob, rank, top ids, top logprobs) of each token; rank 1 = most likely. One
    device-to-host read for all N positions."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0]  # [N]
    ranks = (logp > chosen[:, None]).sum(dim=1) + 1  # [N]
    if num:
        top = torch.topk(logp, num, dim=-1)
        top_ids, top_lp = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_lp = [[] for _ in range(len(ids))]
    return [(c, r, i, v) for c, r, i, v in zip(chosen.tolist(), ranks.tolist(), top_ids, top_lp)]


def mix64(*values: int) -> int:
    """splitmix64-style hash of a tuple of integers into one 63-bit seed."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1  # torch.Generator.manual_seed takes a signed 64-bit value


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MUL1 = _signed64(0xBF58476D1CE4E5B9)
_MUL2 = _signed64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix_tensor(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One step of `mix64` on int64 tensors; multiplication wraps modulo 2^64 like uint64."""
    h = (h ^ v) + _GOLDEN
    h = (h ^ _srl(h, 30)) * _MUL1
    h = (h ^ _srl(h, 27)) * _MUL2
    return h ^ _srl(h, 31)


def counter_uniforms(
    seeds: torch.Tensor,  # [B] int64 (uint64 bit patterns)
    stream: int,
    positions: torch.Tensor,  # [B, P] int64, absolute positions
    slots: int = 2,
) -> torch.Tensor:
    """Counter-based uniforms in [0, 1): [B, P, slots] float64, 53 random bits each.

    u[b, i, s] = hash(seed_b, stream, position_bi, s): a pure function of its counter, so
    a request's draws do not depend on its batch mates or on the device, and the whole
    batch is drawn in a few vectorized integer ops with no host sync (the Philox-style
    counter scheme FlashInfer's kernels use). Slot 0 is the acceptance draw, slot 1 the
    draw that picks a token by inverse CDF.
    """
    h = _mix_tensor(torch.zeros_like(seeds), seeds)[:, None, None]
    h = _mix_tensor(h, torch.full_like(h, stream))
    h = _mix_tensor(h, positions[..., None])
    h = _mix_tensor(h, torch.arange(slots, device=seeds.device, dtype=torch.int64)[None, None, :])
    return _srl(h, 11).double() * (1.0 / (1 << 53))


def seed_tensor(seeds: Sequence[int]) -> torch.Tensor:
    """[B] int64 holding the uint64 bit patterns of request seeds (`counter_uniforms`' input)."""
    return torch.tensor([_signed64(s) for s in seeds], dtype=torch.int64)


def position_uniforms(seed: int, stream: int, positions: list[int]) -> torch.Tensor:
    """[len(positions), 2] float64 draws of one request (see `counter_uniforms`)."""
    seeds = seed_tensor([seed])
    return counter_uniforms(seeds, stream, torch.tensor([positions], dtype=torch.int64).reshape(1, -1))[0]


def sample_inverse_cdf(
    dist: torch.Tensor,  # [..., V] >= 0, rows need not be normalized
    u: torch.Tensor,  # [...] float64 in [0, 1)
) -> torch.Tensor:
    """Token with P(i) = dist[i] / sum(dist): the first i with cdf[i] > u * cdf[-1] -> [...] int64.

    The cumulative sum is float64, so rounding shifts no token's mass by more than ~1e-16
    of the total; a token with zero mass can never be returned (cdf is flat there).
    """
    cdf = torch.cumsum(dist, dim=-1, dtype=torch.float64)
    total = cdf[..., -1]
    # Strictly below the total (u * total can round up to it), so cdf[idx] > x >= cdf[idx - 1]:
    # the token found always has mass.
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[..., None], right=True)[..., 0]


def random_seed() -> int:
    """Seed for a request that did not give one (fresh per session)."""
    return secrets.randbits(63)
