"""Wire forms of a draft (proposal) distribution and how the drafter samples from them.

Rejection sampling is exact for whatever q a draft token was actually sampled from, so
the drafter first turns its processed distribution into the form it will send, then
samples from exactly that form:

  dense    q as float32 / float16 / bfloat16 [K, V]; the drafter samples from the rounded values.
  sparse   q truncated to its top N tokens and renormalized: ids + probs [K, N].
  ids      q is one-hot: the drafter proposes its argmax (greedy drafts, n-gram proposals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.sampling import INT32_MAX, sample_inverse_cdf

DENSE, SPARSE, IDS_ONLY = "dense", "sparse", "ids"
_WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ProposalFormat:
    kind: str = DENSE
    dtype: str = "float32"
    top_n: int = 64

    def __post_init__(self) -> None:
        if self.kind not in (DENSE, SPARSE, IDS_ONLY):
            raise InvalidArgument("proposal_format.kind", f"must be dense, sparse or ids, got {self.kind!r}")
        if self.dtype not in _WIRE_DTYPES:
            raise InvalidArgument("proposal_format.dtype", f"must be one of {', '.join(_WIRE_DTYPES)}, got {self.dtype!r}")
        if self.kind == SPARSE and not 1 <= self.top_n <= INT32_MAX:  # int32 on the wire
            raise InvalidArgument("proposal_format.top_n", f"must be in [1, {INT32_MAX}], got {self.top_n}")


@dataclass(frozen=True)
class Proposal:
    """A proposal in wire form. probs / token_ids are row-major little-endian bytes."""

    kind: str
    dtype: str
    shape: tuple[int, ...]  # dense: (K, V); sparse: (K, N); ids: (K,)
    probs: bytes = b""
    token_ids: bytes = b""  # sparse only, int32

    @property
    def nbytes(self) -> int:
        return len(self.probs) + len(self.token_ids)


def _to_bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit patterns
        t = t.view(torch.int16)
    arr = t.contiguous().cpu().numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def _from_bytes(data: bytes, dtype: str, shape: tuple[int, ...], field: str) -> torch.Tensor:
    torch_dtype = _WIRE_DTYPES.get(dtype, torch.int32 if dtype == "int32" else None)
    if torch_dtype is None:
        raise InvalidArgument(f"{field}.dtype", f"unsupported dtype {dtype!r}")
    elem = torch.finfo(torch_dtype).bits // 8 if torch_dtype.is_floating_point else 4
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", f"dimensions must be >= 0, got {list(shape)}")
    count = math.prod(shape) if shape else 0  # Python ints: np.prod wrapped [4, 2**62] to 0 elements
    if len(data) != count * elem:
        raise InvalidArgument(field, f"has {len(data)} bytes, expected {count * elem} for shape {list(shape)} of {dtype}")
    np_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2", torch.int32: "<i4"}[torch_dtype]
    arr = torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy()).reshape(shape)
    return arr.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else arr


class ProposalBuilder:
    """Turns the drafter's processed distribution at each position into (token, wire row).

    Usage per draft position: `token = builder.sample(probs, u, argmax)` (or `propose`, then
    `commit` of the token kept); once drafted, `builder.build()`.
    """

    def __init__(self, fmt: ProposalFormat, vocab_size: int) -> None:
        self.fmt = fmt
        self.vocab_size = vocab_size
        self._rows: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []
        self._tokens: list[int] = []

    def sample(self, probs: torch.Tensor | None, u: float | torch.Tensor | None, argmax: int | torch.Tensor) -> int:
        """probs: [V] processed q (None for greedy); u: a uniform in [0, 1) that picks the
        token by inverse CDF of the row as sent; argmax: the processed distribution's argmax."""
        token = int(self.propose(probs, u, argmax))
        self.commit(token)
        return token

    def propose(self, probs: torch.Tensor | None, u: float | torch.Tensor | None,
                argmax: int | torch.Tensor) -> torch.Tensor:
        """`sample` without reading the token back: a 0-dim int64 tensor on probs' device, so a
        drafter stepping many rows reads all their tokens in one transfer; `commit` it then."""
        if self.fmt.kind == IDS_ONLY or probs is None:
            return torch.as_tensor(argmax)  # a deterministic proposal is exactly a one-hot q
        u = torch.as_tensor(u, dtype=torch.float64)
        if self.fmt.kind == DENSE:
            row = probs.to(_WIRE_DTYPES[self.fmt.dtype])
            token = sample_inverse_cdf(row.float(), u)
        else:
            n = min(self.fmt.top_n, probs.shape[-1])
            top_probs, top_ids = torch.topk(probs, n)
            row = (top_probs / top_probs.sum()).to(_WIRE_DTYPES[self.fmt.dtype])
            token = top_ids[sample_inverse_cdf(row.float(), u)]
            self._ids.append(top_ids.to(torch.int32))
        self._rows.append(row)
        return token

    @staticmethod
    def propose_rows(builders: list[ProposalBuilder], probs: torch.Tensor, u: torch.Tensor,
                     argmax: torch.Tensor) -> torch.Tensor:
        """`propose` for R rows of one format at once (probs [R, V], u [R] float64, argmax [R]):
        the tokens [R] each row gets alone and its wire row (a sparse row's normalization up
        to float rounding), in a few tensor calls for all of them instead of a few per row
        (on a GPU, each is a kernel launch). Each token is sampled from its row as sent."""
        fmt = builders[0].fmt
        if fmt.kind == IDS_ONLY:
            return argmax
        if fmt.kind == DENSE:
            rows = probs.to(_WIRE_DTYPES[fmt.dtype])  # [R, V]
            tokens = sample_inverse_cdf(rows.float(), u)
        else:
            top_probs, top_ids = torch.topk(probs, min(fmt.top_n, probs.shape[-1]))  # [R, N]
            rows = (top_probs / top_probs.sum(dim=-1, keepdim=True)).to(_WIRE_DTYPES[fmt.dtype])
            tokens = top_ids.gather(1, sample_inverse_cdf(rows.float(), u)[:, None])[:, 0]
            for builder, ids in zip(builders, top_ids.to(torch.int32)):
                builder._ids.append(ids)
        for builder, row in zip(builders, rows):
            builder._rows.append(row)
        return tokens

    def commit(self, token: int) -> None:
        """The token `propose` returned, read back."""
        self._tokens.append(token)

    def keep(self, n: int) -> None:
        """Forget every draft after the first n (a pre-drafted branch answering a smaller γ)."""
        del self._tokens[n:], self._rows[n:], self._ids[n:]

    def build(self) -> Proposal:
        k = len(self._tokens)
        if not self._rows:
            return Proposal(kind=IDS_ONLY, dtype=self.fmt.dtype, shape=(k,))
        probs = torch.stack(self._rows)
        if self.fmt.kind == DENSE:
            return Proposal(kind=DENSE, dtype=self.fmt.dtype, shape=tuple(probs.shape), probs=_to_bytes(probs))
        ids = torch.stack(self._ids)
        return Proposal(
            kind=SPARSE, dtype=self.fmt.dtype, shape=tuple(probs.shape), probs=_to_bytes(probs), token_ids=_to_bytes(ids)
        )


@dataclass(frozen=True)
class DraftQ:
    """A decoded proposal, as compact as it came: dense q [K, V'] (V' <= the verifier's V; the
    ids past it have probability 0), or sparse q given by `probs` at `ids` ([K, N] each; the
    dense row is their scatter-add, so a repeated id sums). Rows need not be normalized:
    `sums` [K] divides them, as a drafter sampling by inverse CDF samples q / sum. Kept
    sparse, a sparse q crosses to the device as [B, K, N] and is made dense there."""

    probs: torch.Tensor  # [K, V'] or [K, N] float32, finite, >= 0
    ids: torch.Tensor | None  # [K, N] int64 in [0, V) for a sparse q; None for a dense one
    sums: torch.Tensor  # [K], each > 0 and finite

    def at(self, token_ids: list[int]) -> torch.Tensor:
        """[K] q (unnormalized) of each row's draft token."""
        tokens = torch.tensor(token_ids, dtype=torch.long)[:, None]  # [K, 1]
        if self.ids is None:
            inside = tokens < self.probs.shape[1]
            return torch.where(inside, self.probs.gather(1, tokens.clamp(max=self.probs.shape[1] - 1)), 0.0)[:, 0]
        return (self.probs * (self.ids == tokens)).sum(dim=1)

    def dense(self, vocab_size: int) -> torch.Tensor:
        """[K, V] float32."""
        if self.ids is None:
            width = self.probs.shape[1]
            return self.probs if width == vocab_size else torch.nn.functional.pad(self.probs, (0, vocab_size - width))
        return torch.zeros(self.probs.shape[0], vocab_size).scatter_add_(1, self.ids, self.probs)


def decode_proposal(proposal: Proposal, num_draft: int, vocab_size: int) -> torch.Tensor | None:
    """Dense q [num_draft, V] float32 (rows not necessarily normalized), or None for one-hot."""
    q = decode_draft_q(proposal, num_draft, vocab_size)
    return None if q is None else q.dense(vocab_size)


def decode_draft_q(proposal: Proposal, num_draft: int, vocab_size: int) -> DraftQ | None:
    """The proposal checked and decoded (`DraftQ`), or None for one-hot (ids-only)."""
    if proposal.kind == IDS_ONLY:
        return None
    if len(proposal.shape) != 2 or proposal.shape[0] != num_draft:
        raise InvalidArgument("proposal.shape", f"must be [{num_draft}, ...] for {num_draft} draft tokens, got {list(proposal.shape)}")
    probs = _from_bytes(proposal.probs, proposal.dtype, proposal.shape, "proposal.probs").float()
    ids = None
    if proposal.kind == DENSE:
        # A drafter's LM head may be smaller than this one (padded heads of one tokenizer): its
        # proposal gives the ids past it probability 0.
        if not 1 <= proposal.shape[1] <= vocab_size:
            raise InvalidArgument("proposal.shape", f"dense proposals are [{num_draft}, V] with 1 <= V <= {vocab_size}, "
                                                    f"got {list(proposal.shape)}")
    elif proposal.kind == SPARSE:
        ids = _from_bytes(proposal.token_ids, "int32", proposal.shape, "proposal.token_ids").long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise InvalidArgument("proposal.token_ids", f"ids must be in [0, {vocab_size})")
        ordered = ids.sort(dim=1).values  # [K, N]
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):  # a row is a top-N set: a repeat has no meaning
            raise InvalidArgument("proposal.token_ids", "ids must be distinct within a row")
    else:
        raise InvalidArgument("proposal.kind", f"unknown kind {proposal.kind!r}")
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise InvalidArgument("proposal.probs", "probabilities must be finite and >= 0")
    sums = probs.sum(dim=1)
    if bool((sums <= 0).any()):
        raise InvalidArgument("proposal.probs", "every row needs positive mass")
    if not bool(torch.isfinite(sums).all()):
        # Finite entries whose float32 sum overflows (rows need not be normalized): q / inf would
        # be 0 at every draft, and u·0 < p accepts them all. The same distribution scaled to a max of 1.
        probs = probs / probs.amax(dim=1, keepdim=True)
        sums = probs.sum(dim=1)
    return DraftQ(probs, ids, sums)
