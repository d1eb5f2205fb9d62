"""The fast path: a static-shape batched decoder forward over a KV slot pool, replayed as
one CUDA graph per shape bucket on CUDA.

Why: on a GPU, eager transformers (and our SlotForward's per-row attention loop) is bound
by kernel launches and Python, not by the hardware: a 1.5B verify step costs ~19 ms against
a ~1 ms memory-bandwidth limit. gpt-fast's recipe closes that gap: static shapes, a
preallocated KV cache, and CUDA graphs. Here every input of a step lives in preallocated
buffers of a bucket shape (B rows × T tokens, C context positions); the step reads them,
writes K/V into the pool by index and leaves hidden states in an output buffer, so one captured
graph per bucket replays the whole forward with a single launch and no host sync.

Shapes of one step (a bucket):
  ids    [B, T]  token ids; a row's tokens are left-aligned, the tail is padding
  slot   [B]     pool row of each batch row (the pool's scratch row for padded rows)
  start  [B]     cached positions of each row before this step
  nreal  [B]     real tokens of each row (0 for padded rows)
  hidden [B, T, hidden] after the final norm, in the model's dtype

Padded tokens write K/V into the scratch row, never into a session's slot, and no real
query can see them (the causal mask of a real token stops at its own position), so
padding never changes a row's output. Attention reads a row's slot gathered up to the
bucket's context C (the next power of two above the longest row), masked per row; GQA
is computed by folding the query heads of each KV head into the query axis
([B, H_kv, G·T, D]), so no KV head is repeated in memory and any SDPA backend applies.

A row wider than the widest step row (a prompt chunk) runs on the same path, cut into pieces
of up to PIECE_WIDTH tokens that are rows of one static step: each piece starts where the
one before ends, and within every layer all rows write their K/V before any row reads its
slot, so a piece attends to the pieces before it as a prefill would. Pieces go in their own
step (T = PIECE_WIDTH) and decode rows in theirs (T = γ + 1 or so), so neither pads to the
other's width. Only rows outside the pool (or every wide row when the model prefills
through a second weight copy) go through SlotForward, eagerly.

The steps (and graphs) end at the final norm: [B, T, hidden]. The LM head runs once per
forward on the positions a row keeps, so padding and a prompt's unread positions cost no
vocabulary-wide matmul, and the graphs' shared output holds hidden states, not logits
([max B · T · hidden] instead of [max B · T · V]: 1.2 GB less at B = 128 with a 152k vocabulary).
On the CPU the same steps run eagerly: that is what the tests compare with the eager path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from typing import Callable

from specdec.slot_forward import Row, SlotForward, SlotPool, check_rows, rms_norm, rotate, signed_sin

log = logging.getLogger(__name__)

# Padding rows or tokens costs compute (at B=64 a verify is no longer purely weight-bound),
# so the common shapes are exact: widths 1 (decode), 2 (drafter catch-up), γ+1 up to γ=8.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
WIDTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 24, 32)
PIECE_WIDTH = WIDTH_BUCKETS[-1]  # a prompt chunk's rows: wide enough that a piece's MLP is compute-bound
MIN_CONTEXT_BUCKET = 64  # then 64·2^k and 96·2^k: attention reads at most 1.5x the longest row
STATIC_ROPE_TYPES = (None, "default", "linear", "llama3")  # cos/sin of a position never change


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def static_supported(model) -> bool:
    scaling = getattr(model.config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    return rope_type in STATIC_ROPE_TYPES


@dataclass(frozen=True)
class _Piece:
    """One row of a static step: `token_ids` appended at position `start` of pool row
    `index`, for row `row` of the forward, whose kept positions in this piece are
    token_ids[keep_from:]."""

    row: int
    index: int
    start: int
    token_ids: list[int]
    keep_from: int


@dataclass
class _Bucket:
    """Static buffers of one (B, T, C) shape, and its CUDA graph once captured. The inputs
    are views of one int64 tensor [B·T + 3B], so a step's inputs cross to the device in
    one copy."""

    inputs: torch.Tensor  # [B·T + 3B] long: ids, slot, start, nreal
    B: int
    T: int
    hidden: torch.Tensor | None = None  # [B, T, hidden]: the graph's output, a view of the shared buffer
    graph: object | None = None  # torch.cuda.CUDAGraph

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B, T], slot [B], start [B], nreal [B])."""
        B, T = self.B, self.T
        ids, slot, start, nreal = torch.split(self.inputs, [B * T, B, B, B])
        return ids.view(B, T), slot, start, nreal


class StaticForward:
    """Bucketed static-shape forward over `pool`; CUDA graphs when `graphs` (CUDA only)."""

    def __init__(self, slots: SlotForward, pool: SlotPool, graphs: bool | None = None,
                 max_batch: int = BATCH_BUCKETS[-1], max_width: int = WIDTH_BUCKETS[-1], pieces: bool = True) -> None:
        """max_batch: the largest batch bucket (more rows run in chunks). max_width: the
        widest row of a step (a verify); wider rows run as pieces of PIECE_WIDTH tokens when
        `pieces`, else eagerly. The graphs' shared output is [max_batch · widest bucket · hidden]."""
        if not static_supported(slots.model):
            raise ValueError("the static forward precomputes rotary tables; this model's rope scaling changes them "
                             "with the length")
        self.slots = slots
        self.pool = pool
        self.model = slots.model
        self.device = slots.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not 1 <= max_batch or not 1 <= max_width <= WIDTH_BUCKETS[-1]:
            raise ValueError(f"need max_batch >= 1 and 1 <= max_width <= {WIDTH_BUCKETS[-1]}")
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.max_width = max_width
        self.pieces = pieces
        self.piece_width = max(PIECE_WIDTH, max_width) if pieces else max_width
        self.width_buckets = tuple(w for w in WIDTH_BUCKETS if w < max_width) + (max_width,)
        if self.piece_width > max_width:
            self.width_buckets += (self.piece_width,)
        self.max_len = slots.max_len
        self.groups = slots.num_heads // slots.num_kv_heads
        inner = self.model.model
        with torch.inference_mode():
            positions = torch.arange(self.max_len, device=self.device)[None]  # [1, M]
            probe = torch.zeros(1, self.max_len, 1, dtype=slots.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)  # [1, M, D] each, attention scaling folded in
        self.cos, self.sin = cos[0], signed_sin(sin[0])  # [M, D]; sin signed for `rotate`
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        # Graph outputs: one flat buffer shared by every graph (each writes its first B·T·hidden
        # elements), allocated outside the graphs' pool, so no graph keeps an output tensor
        # alive and the pool only ever holds one step's activations.
        self._graph_out: torch.Tensor | None = None

    def accepts(self, row: Row) -> bool:
        """Whether `row` runs on this path (as one step row, or as pieces)."""
        return row.slot.index is not None and (self.pieces or len(row.token_ids) <= self.max_width)

    def context_bucket(self, end: int) -> int:
        c = MIN_CONTEXT_BUCKET
        while c < end:
            c = c * 3 // 2 if c & (c - 1) == 0 else c * 4 // 3  # 64, 96, 128, 192, 256, ...
        return min(c, self.max_len)

    @torch.inference_mode()
    def forward(self, rows: list[Row],
                eager: Callable[[list[Row]], list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
        """Append each row's tokens to its slot; per row the logits [keep, V] float32 of its
        last `keep` positions. Pool rows of up to max_width tokens run as static steps (in
        chunks of the largest batch bucket), wider pool rows as pieces in steps of their own;
        the rest run through `eager` (default: the slot forward)."""
        check_rows(rows)
        eager = eager or self._eager
        out: list[torch.Tensor | None] = [None] * len(rows)
        static = [i for i, r in enumerate(rows) if self.accepts(r)]
        if static:
            kept, parts = [], []  # per step the kept hidden states; per part (row, start, positions)
            chunk_size = self.batch_buckets[-1]
            for group in self._pieces(rows, static):
                for lo in range(0, len(group), chunk_size):
                    chunk = group[lo : lo + chunk_size]
                    kept.append(self._static(chunk))
                    parts += [(p.row, p.start, len(p.token_ids) - p.keep_from) for p in chunk
                              if p.keep_from < len(p.token_ids)]
            hidden = torch.cat(kept) if len(kept) > 1 else kept[0]  # [sum keep, hidden], in step order
            if parts != sorted(parts):  # back to row order: a wide row came before a short one
                split = torch.split(hidden, [n for _, _, n in parts])
                hidden = torch.cat([split[j] for j in sorted(range(len(parts)), key=parts.__getitem__)])
            logits = self.model.lm_head(hidden).float()  # [sum keep, V]
            for i, part in zip(static, torch.split(logits, [rows[i].keep for i in static])):
                out[i] = part
            for i in static:
                rows[i].slot.length += len(rows[i].token_ids)
        rest = [i for i, r in enumerate(rows) if not self.accepts(r)]
        if rest:
            for i, logits in zip(rest, eager([rows[i] for i in rest])):
                out[i] = logits
        return out

    def _pieces(self, rows: list[Row], static: list[int]) -> tuple[list[_Piece], list[_Piece]]:
        """The step rows of rows[static]: (rows of up to max_width tokens, the PIECE_WIDTH
        pieces of wider rows), each in row order. Two groups, so that decode rows never pad to
        a piece's width; a row keeps its last `keep` positions, wherever its pieces end."""
        short, wide = [], []
        for i in static:
            r = rows[i]
            n = len(r.token_ids)
            group, width = (short, n) if n <= self.max_width else (wide, self.piece_width)
            for lo in range(0, n, width):
                group.append(_Piece(i, r.slot.index, r.slot.length + lo, r.token_ids[lo : lo + width],
                                    keep_from=max(0, n - r.keep - lo)))
        return short, wide

    def _eager(self, rows: list[Row]) -> list[torch.Tensor]:
        return list(torch.split(self.slots.forward(rows), [r.keep for r in rows]))

    def _static(self, pieces: list[_Piece]) -> torch.Tensor:
        """One static step of `pieces`; the hidden states [sum kept, hidden] of the positions
        they keep, in piece order (a copy: a graph's output is overwritten by the next replay)."""
        B = _bucket(len(pieces), self.batch_buckets)
        T = _bucket(max(len(p.token_ids) for p in pieces), self.width_buckets)
        C = self.context_bucket(max(p.start + len(p.token_ids) for p in pieces))
        bucket = self._bucket_for(B, T, C)
        host = [0] * (B * T) + [self.pool.scratch] * B + [0] * (2 * B)  # padding: scratch slot, 0 tokens
        for b, p in enumerate(pieces):
            n = len(p.token_ids)
            host[b * T : b * T + n] = p.token_ids
            host[B * T + b], host[B * T + B + b], host[B * T + 2 * B + b] = p.index, p.start, n
        bucket.inputs.copy_(torch.tensor(host, dtype=torch.long), non_blocking=True)
        if bucket.graph is not None:
            with self._on_device():
                bucket.graph.replay()
            hidden = bucket.hidden
        else:
            hidden = self._step(*bucket.views(), C)
        width = hidden.shape[-1]
        if all(p.keep_from == 0 and len(p.token_ids) == T for p in pieces):  # a verify of equal widths
            kept = hidden[: len(pieces)].reshape(-1, width)
            return kept.clone() if bucket.graph is not None else kept
        index = [b * T + t for b, p in enumerate(pieces) for t in range(p.keep_from, len(p.token_ids))]
        # non_blocking: a blocking copy would wait for the step on the device (a host sync per step)
        index = torch.tensor(index, dtype=torch.long).to(hidden.device, non_blocking=True)
        return hidden.view(-1, width).index_select(0, index)

    def _bucket_for(self, B: int, T: int, C: int, warmup: int = 2) -> _Bucket:
        key = (B, T, C)
        bucket = self._buckets.get(key)
        if bucket is None:
            inputs = torch.zeros(B * T + 3 * B, dtype=torch.long, device=self.device)
            inputs[B * T : B * T + B] = self.pool.scratch  # an all-padding batch until the first copy
            bucket = _Bucket(inputs=inputs, B=B, T=T)
            if self.graphs:
                with self._on_device():
                    self._capture(bucket, C, warmup)
            self._buckets[key] = bucket
        return bucket

    def capture_all(self) -> tuple[int, float]:
        """Capture every bucket (batch x width x context up to the pool's length) now, so no
        request pays a capture inside its step; returns (graphs captured, seconds). A no-op
        without CUDA graphs (the CPU runs eagerly). The warm-up runs before a capture (lazy
        inits, cuBLAS workspaces) happen once per (batch, width): the other contexts of that
        shape run the same kernels on longer keys, and skipping them makes the grid ~3x faster."""
        if not self.graphs:
            return 0, 0.0
        t0, before = time.perf_counter(), len(self._buckets)
        contexts = sorted({self.context_bucket(n) for n in range(1, self.max_len + 1)})
        with torch.inference_mode():
            for B in self.batch_buckets:
                for T in self.width_buckets:
                    for i, C in enumerate(contexts):
                        self._bucket_for(B, T, C, warmup=2 if i == 0 else 0)
        torch.cuda.synchronize(self.device)
        return len(self._buckets) - before, time.perf_counter() - t0

    def _on_device(self):
        """Make the pool's device current: torch.cuda.graph captures on the current device's
        stream, so a model on cuda:1 would otherwise be captured empty."""
        return torch.cuda.device(self.device) if self.graphs else contextlib.nullcontext()

    def _capture(self, bucket: _Bucket, C: int, warmup: int = 2) -> None:
        """Record one step of this bucket as a CUDA graph. The buffers hold an all-padding
        batch (every row the scratch slot, 0 real tokens), so the warm-up runs, which do
        execute, write only the scratch row."""
        args = (*bucket.views(), C)
        B, T = bucket.B, bucket.T
        width = self.model.config.hidden_size
        if self._graph_out is None:
            self._graph_out = torch.empty(self.batch_buckets[-1] * self.width_buckets[-1] * width,
                                          dtype=self.slots.dtype, device=self.device)
        out = self._graph_out[: B * T * width].view(B, T, width)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS workspaces, lazy inits
            for _ in range(warmup):
                self._step(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call of another thread (a gRPC handler) must not void the capture.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out.copy_(self._step(*args))
        bucket.hidden, bucket.graph = out, graph
        log.debug("captured CUDA graph B=%d T=%d C=%d", B, T, C)

    def _step(self, ids: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, nreal: torch.Tensor,
              C: int) -> torch.Tensor:
        """One forward of a bucket from its buffers (shapes in the module docstring); returns
        the normed hidden states [B, T, hidden]. Pure tensor ops on the device: capturable, no
        host sync."""
        B, T = ids.shape
        sf, inner = self.slots, self.model.model
        H, Hkv, D, G = sf.num_heads, sf.num_kv_heads, sf.head_dim, self.groups
        t = torch.arange(T, device=ids.device)  # [T]
        pos = start[:, None] + t  # [B, T]
        real = t[None, :] < nreal[:, None]  # [B, T]
        # Padded tokens go to the scratch row at positions 0..T-1: in bounds, never read as real.
        write_slot = torch.where(real, slot[:, None], self.pool.scratch)  # [B, T]
        write_pos = torch.where(real, pos, t.clamp(max=self.max_len - 1)[None, :])  # [B, T]
        rope_pos = pos.clamp(max=self.max_len - 1)  # a padded token's position may pass the end
        cos, sin = self.cos[rope_pos][:, :, None, :], self.sin[rope_pos][:, :, None, :]  # [B, T, 1, D]
        # Query (g, t) of KV head j sits at row g·T + t; it may see keys 0..pos[t].
        allowed = torch.arange(C, device=ids.device)[None, None, :] <= pos[:, :, None]  # [B, T, C]
        allowed = allowed[:, None].repeat(1, 1, G, 1)  # [B, 1, G·T, C]
        h = inner.embed_tokens(ids)  # [B, T, hidden]
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = rms_norm(layer.input_layernorm, h)
            q = attn.q_proj(x).view(B, T, H, D)
            k = attn.k_proj(x).view(B, T, Hkv, D)
            v = attn.v_proj(x).view(B, T, Hkv, D)
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k_pool, v_pool = self.pool.data[:, li, 0], self.pool.data[:, li, 1]  # [S + 1, H_kv, M, D] views
            k_pool[write_slot, :, write_pos] = k.to(k_pool.dtype)  # index_put_ of [B, T, H_kv, D]
            v_pool[write_slot, :, write_pos] = v.to(v_pool.dtype)
            keys = k_pool[slot, :, :C].to(q.dtype)  # [B, H_kv, C, D]
            values = v_pool[slot, :, :C].to(q.dtype)
            qg = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=allowed, scale=attn.scaling)
            o = o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)  # head = j·G + g
            h = h + attn.o_proj(o)
            h = h + layer.mlp(rms_norm(layer.post_attention_layernorm, h))
        return rms_norm(inner.norm, h)  # [B, T, hidden]

    def shape_count(self) -> int:
        return len(self._buckets)


