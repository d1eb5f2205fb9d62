"""SamplingParams (vLLM's names and meanings), logits processing, and seeded noise.

Drafter and verifier process logits with the same function, so the proposal q and the
target p are distributions of the same kind: losslessness is with respect to the
target's *processed* distribution.

Randomness scheme (reproducible, independent of batch composition): every random draw
for a request is made from a `torch.Generator` seeded with
`mix64(seed, stream, position)`, where `position` is the absolute index of the token
being decided in the session's sequence and `stream` separates the drafter's draws from
the verifier's. A position is decided exactly once by the verifier (later rounds start
after it), so no draw is reused; the drafter may re-draft a position after a rejection,
but the earlier draft at that position never influenced any emitted token.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidArgument

STREAM_DRAFT = 1
STREAM_VERIFY = 2
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters with vLLM's names and defaults.

    temperature 0 selects greedy decoding; top_k 0 and top_p 1 disable those filters.
    max_tokens / stop / stop_token_ids / ignore_eos are enforced by the client;
    temperature / top_k / top_p / min_p / seed travel to both services.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0 disables top-k), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1] (1 disables top-p), got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidArgument("min_p", f"must be in [0, 1] (0 disables min-p), got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed <= _MASK64):
            raise InvalidArgument("seed", f"must be an unsigned 64-bit integer, got {self.seed}")
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", "token ids must be >= 0")

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed sampling distribution for one request.

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


def random_seed() -> int:
    """Seed for a request that did not give one (fresh per session)."""
    return secrets.randbits(63)


def position_noise(
    seed: int, stream: int, positions: list[int], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws for the given absolute positions, each from its own generator.

    Returns uniform: [len(positions)] in [0, 1) and exp_noise: [len(positions), vocab_size]
    Exp(1) samples (clamped away from 0). `argmax(probs / exp_noise)` samples from
    normalize(probs) (the exponential race, as in gpt-fast), so unnormalized residuals
    need no division and no host sync.
    """
    uniform = torch.empty(len(positions))
    exp_noise = torch.empty(len(positions), vocab_size)
    for i, pos in enumerate(positions):
        gen = torch.Generator().manual_seed(mix64(seed, stream, pos))
        uniform[i : i + 1].uniform_(generator=gen)
        exp_noise[i].exponential_(generator=gen)
    return uniform, exp_noise.clamp_min_(torch.finfo(torch.float32).tiny)


def sample_with_noise(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Categorical sample of each row of (possibly unnormalized) probs.

    probs: [..., V] >= 0; exp_noise: [..., V] Exp(1) -> ids: [...] int64.
    """
    return torch.argmax(probs / exp_noise, dim=-1)
