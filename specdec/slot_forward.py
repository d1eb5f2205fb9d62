"""One forward over many sessions: static per-session KV slots and a flat, unpadded batch.

A session's KV cache is a `KVSlot`: one preallocated tensor
[num_layers, 2, num_kv_heads, max_len, head_dim] whose first `length` positions are
valid. Truncation only moves `length`; nothing is copied or re-padded between rounds, and
shapes are static (what CUDA-graph capture needs later).

`SlotForward.forward` runs a llama-family decoder (llama, mistral, qwen2, qwen3: RMSNorm,
rotary, GQA, gated MLP) over B sessions at once, gpt-fast style, reusing the Hugging Face
modules' weights. Tokens of all rows are concatenated ([N, hidden], N = sum T_b, no
padding), so every linear layer runs once for the whole batch — the part that reads the
weights and dominates decode cost. Attention runs per row against that row's slot view
(no gather, no copy), with a causal mask offset by the row's cached length.
"""

from __future__ import annotations

import collections
import gc
import math
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.errors import ResourceExhausted

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(eq=False)
class KVSlot:
    """Static KV storage of one session: data [L, 2, H_kv, max_len, D]; `length` valid positions.
    `index` is its row in a SlotPool (None for a slot allocated on its own)."""

    data: torch.Tensor
    length: int = 0
    index: int | None = None

    @property
    def max_len(self) -> int:
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class SlotPool:
    """Every KV slot of a model in one preallocated tensor [S + 1, L, 2, H_kv, max_len, D].

    What the static (CUDA-graph) forward needs: a batch names its rows' slots by index
    into one tensor, so a captured graph reads any session's cache without new pointers.
    Row S is scratch: padded rows and padded tokens of a static batch write there, never
    into a session's slot. A slot returns to the free list when its last reference dies
    (weakref.finalize), not by an explicit call: a slot moves between a session and the
    drafter's speculation branches, and whoever drops it last is the only one who knows
    it is free, so it cannot be handed out while a branch or a request still holds it.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"a slot pool needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.data = torch.zeros((num_slots + 1, num_layers, 2, num_kv_heads, max_len, head_dim),
                                dtype=dtype, device=device)
        self._free = collections.deque(range(num_slots))
        # Re-entrant: a slot's finalizer may run (and return it) in this thread while it holds
        # the lock, when a garbage collection fires inside acquire.
        self._freed = threading.Condition(threading.RLock())

    @property
    def scratch(self) -> int:
        return self.num_slots

    @property
    def free_slots(self) -> int:
        with self._freed:
            return len(self._free)

    def acquire(self, wait_s: float = 0.0) -> KVSlot:
        """A free slot; when none is, wait up to `wait_s` for one. A session closed while its
        call is in flight keeps its slot until that call ends, within a step: a new session
        opened meanwhile on a full server waits for it instead of being refused (the client
        retried later, and the refusal named --max-sessions, which was not the cause)."""
        deadline = time.monotonic() + wait_s
        collected = False
        while True:
            with self._freed:
                if not self._free and wait_s > 0:
                    self._freed.wait(max(0.0, min(deadline - time.monotonic(), 0.05)))
                index = self._free.popleft() if self._free else None
            if index is not None or time.monotonic() >= deadline:
                break
            if not collected:  # a slot in a reference cycle (a traceback's frames) returns only with a collection
                gc.collect()
                collected = True
        if index is None:  # raised outside the lock: a collection here may run a slot's finalizer
            raise ResourceExhausted(f"all {self.num_slots} KV slots of the pool are held (sessions, speculation "
                                    "branches, and closed sessions whose calls have not ended yet); retry later")
        slot = KVSlot(self.data[index], index=index)
        weakref.finalize(slot, self._release, index)
        return slot

    def _release(self, index: int) -> None:
        with self._freed:
            self._free.append(index)
            self._freed.notify()


def copy_prefix(dst: KVSlot, src: KVSlot, length: int) -> None:
    """Fork: dst holds src's first `length` positions (a copy of [L, 2, H_kv, length, D])."""
    dst.data[:, :, :, :length].copy_(src.data[:, :, :, :length])
    dst.length = length


@dataclass(frozen=True)
class Row:
    """One session's part of a batched forward: append `token_ids` after `slot.length`
    cached tokens, and return logits for the last `keep` of them."""

    slot: KVSlot
    token_ids: list[int]
    keep: int = 1


def check_rows(rows: list[Row]) -> None:
    for r in rows:
        if not r.token_ids or not 1 <= r.keep <= len(r.token_ids):
            raise ValueError("each row appends >= 1 token and keeps 1..len(token_ids) logits")
        if r.slot.length + len(r.token_ids) > r.slot.max_len:
            raise ValueError(f"row needs {r.slot.length + len(r.token_ids)} positions, the slot has {r.slot.max_len}")


def supports(model) -> bool:
    cfg = model.config
    return (getattr(cfg, "model_type", None) in SUPPORTED_MODEL_TYPES
            and not getattr(cfg, "sliding_window", None)  # every layer attends to the full context
            and hasattr(model, "model") and hasattr(model.model, "rotary_emb"))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., D] sin table -> [-sin_lo, sin_hi], for `rotate`: HF's rotate_half(x) * sin equals
    roll(x, D/2) * signed_sin(sin) exactly (negation is exact), in 4 ops per tensor, not 7."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., D] (HF's half-split layout); sin_signed from signed_sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A llama-family RMSNorm module's output in one fused kernel instead of its seven eager ops
    (44 -> 21 us per call on the CPU at decode shapes, 61 calls per step of a 30-layer model).
    Same arithmetic as the module: normalize in float32, cast back, then scale by the weight."""
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), shape, None, norm.variance_epsilon).to(x.dtype)


class SlotForward:
    """Batched decoder forward over KV slots for a loaded HF llama-family model."""

    def __init__(self, model, max_len: int) -> None:
        if not supports(model):
            raise ValueError(f"model type {getattr(model.config, 'model_type', '?')!r} has no slot forward; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} without sliding windows")
        self.model = model
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_len = max_len
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # Attention in float32 for a half-precision model on a CPU: PyTorch's float16 / bfloat16
        # CPU attention kernel is 5-8x slower than its float32 one at decode shapes (9 heads over
        # 3 KV heads, 200 keys: 437 vs ~70 us with the upcasts; 800 keys: 1,426 us vs ~200), 30
        # times per step of the 135M drafter. The KV slot keeps the model's dtype.
        self.upcast_attention = self.device.type == "cpu" and self.dtype in (torch.float16, torch.bfloat16)

    def new_pool(self, num_slots: int) -> SlotPool:
        return SlotPool(num_slots, self.num_layers, self.num_kv_heads, self.max_len, self.head_dim,
                        self.dtype, self.device)

    def new_slot_bytes(self) -> int:
        return (self.num_layers * 2 * self.num_kv_heads * self.max_len * self.head_dim
                * self.dtype.itemsize)

    def new_slot(self) -> KVSlot:
        # torch.empty: pages are only committed when written, so an idle slot costs address
        # space, not resident memory; freeing the session returns it.
        shape = (self.num_layers, 2, self.num_kv_heads, self.max_len, self.head_dim)
        return KVSlot(torch.empty(shape, dtype=self.dtype, device=self.device))

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> torch.Tensor:
        """Append each row's tokens to its slot; logits [sum keep_b, V] float32, rows in order."""
        check_rows(rows)
        inner = self.model.model
        dev = self.device
        lengths = [len(r.token_ids) for r in rows]
        starts = [r.slot.length for r in rows]
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long, device=dev)  # [N]
        positions = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, lengths)])  # [N]
        h = inner.embed_tokens(ids)  # [N, hidden]
        cos, sin = inner.rotary_emb(h[None], positions[None])  # [1, N, D] each
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [N, 1, D]: broadcast over heads
        sin = signed_sin(sin)
        masks = [self._causal_mask(s, n) for s, n in zip(starts, lengths)]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = rms_norm(layer.input_layernorm, h)
            q = attn.q_proj(x).view(-1, self.num_heads, self.head_dim)  # [N, H, D]
            k = attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)  # [N, H_kv, D]
            v = attn.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            out = torch.empty_like(q)  # [N, H, D]
            for b, r in enumerate(rows):
                lo, hi, start = bounds[b], bounds[b + 1], starts[b]
                kv = r.slot.data[li]  # [2, H_kv, max_len, D]
                kv[0, :, start : start + hi - lo] = k[lo:hi].transpose(0, 1)
                kv[1, :, start : start + hi - lo] = v[lo:hi].transpose(0, 1)
                keys, values = kv[0, :, : start + hi - lo], kv[1, :, : start + hi - lo]  # [H_kv, S_b, D]
                query = q[lo:hi]
                if self.upcast_attention:
                    query, keys, values = query.float(), keys.float(), values.float()
                elif keys.dtype != q.dtype:  # a prefill model of another dtype writing this slot
                    keys, values = keys.to(q.dtype), values.to(q.dtype)
                o = F.scaled_dot_product_attention(
                    query.transpose(0, 1)[None], keys[None], values[None],  # [1, H, T_b, D], [1, H_kv, S_b, D]
                    attn_mask=masks[b], scale=attn.scaling, enable_gqa=self.num_kv_heads != self.num_heads,
                )
                out[lo:hi] = o[0].transpose(0, 1)  # back to the model's dtype
            h = h + attn.o_proj(out.reshape(-1, self.num_heads * self.head_dim))
            h = h + layer.mlp(rms_norm(layer.post_attention_layernorm, h))
        for r, n in zip(rows, lengths):
            r.slot.length += n
        keep = torch.cat([torch.arange(bounds[b + 1] - r.keep, bounds[b + 1], device=dev) for b, r in enumerate(rows)])
        return self.model.lm_head(rms_norm(inner.norm, h[keep])).float()  # [sum keep, V]

    def _causal_mask(self, start: int, n: int) -> torch.Tensor | None:
        """[n, start + n] bool, True = may attend: query t sees keys 0..start + t. None for n = 1."""
        if n == 1:
            return None
        cols = torch.arange(start + n, device=self.device)[None, :]
        return cols <= (start + torch.arange(n, device=self.device))[:, None]


def check_matches_reference(model, fwd: SlotForward, token_ids: list[int], atol: float = 1e-3) -> float:
    """Max |logit difference| between the slot forward and the HF forward on one sequence;
    raises beyond `atol` (a check for a new model family)."""
    slot = fwd.new_slot()
    ours = fwd.forward([Row(slot, token_ids, keep=len(token_ids))])
    with torch.inference_mode():
        ref = model(torch.tensor([token_ids], device=fwd.device)).logits[0].float()
    diff = float((ours - ref).abs().max())
    if not math.isfinite(diff) or diff > atol:
        raise RuntimeError(f"slot forward differs from the reference by {diff:g} (> {atol:g})")
    return diff
