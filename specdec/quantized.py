"""Weight-only int4 linears (and an int8 LM head) for a CPU drafter (`--quantize int4`).

Why: a decode step of a small drafter on a CPU is bound by reading its weights. The
embedded 135M model's float16 / bfloat16 step costs about as much as the float32 target's
(~30 ms each on an AMX host), so a same-size drafter saves nothing there; with its decoder
linears in int4 (asymmetric, one bfloat16 scale and zero per group of 32 inputs) the step
takes ~15 ms and greedy agreement with the target stays ~0.98 (README, "the drafter's
dtype"). The LM head (49152 x 576, a fifth of the weights) in int8, one scale per output
row, takes the step to ~14 ms at the same agreement; in int4 agreement fell to 0.875.
Activations stay bfloat16, the input embedding stays unquantized.

The kernels are ATen's `_weight_int4pack_mm_for_cpu` (w = (q − 8)·scale + zero per group)
and `_weight_int8pack_mm` (w = q·scale per row): the same arithmetic for every row, so a
row's output does not depend on its batch mates (checked bit for bit; the dynamic int8
path, whose activation scale spans the batch, has to run rows one at a time).
"""

from __future__ import annotations

import functools

import torch

GROUP_SIZE = 32
_INNER_K_TILES = 2  # the packing's K tiling; 2 is what the CPU kernel accepts for any K % 32 == 0


def quantize_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int32 in 0..15, scale [N, K/g], zero [N, K/g]) float32 with
    weight ≈ (q − 8)·scale + zero: min/max per group, so both ends of a group are exact."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)  # [N, K/g, g]
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo).clamp(min=1e-12) / 15
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo + 8 * scale


class Int4WeightLinear(torch.nn.Module):
    """A bias-free nn.Linear with its weight packed as int4; computes in bfloat16."""

    def __init__(self, linear: torch.nn.Linear, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("int4 weight packing covers bias-free linears (llama-family decoder layers)")
        self.out_features, self.in_features = linear.weight.shape
        self.group_size = group_size
        q, scale, zero = quantize_groups(linear.weight.detach(), group_size)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES))
        # [K/g, N, 2]: the kernel's layout of (scale, zero) per group and output
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)  # [M, N]
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8WeightLinear(torch.nn.Module):
    """A bias-free nn.Linear with its weight in int8, symmetric, one bfloat16 scale per output
    row; computes in bfloat16. Holds a copy: a tied input embedding keeps its own weights."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("int8 weight packing covers bias-free linears (an LM head)")
        self.out_features, self.in_features = linear.weight.shape
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127  # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        out = torch._weight_int8pack_mm(rows, self.qweight, self.scales)  # [M, N]
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def int4_packable(linear: torch.nn.Module, group_size: int = GROUP_SIZE) -> bool:
    return (isinstance(linear, torch.nn.Linear) and linear.bias is None
            and linear.in_features % group_size == 0 and linear.out_features % 16 == 0)


def quantize_int4(layers: torch.nn.Module, group_size: int = GROUP_SIZE) -> int:
    """Replace every packable nn.Linear under `layers` (the decoder layers) in place; returns
    how many. Others (a bias, an odd width) stay as they are."""
    targets = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
               if int4_packable(child, group_size)]
    for parent, name, child in targets:
        setattr(parent, name, Int4WeightLinear(child, group_size))
    return len(targets)


@functools.cache
def int4_available() -> bool:
    """Whether this torch build has the CPU int4 and int8 weight-only kernels (PyTorch >= 2.5).
    It runs them once, which leaves an OpenMP team on the calling thread: call it on a
    short-lived one (models._on_own_thread; on the engine's thread-to-be the int4 drafter's
    step went from 14 to 34 ms)."""
    try:
        lin = torch.nn.Linear(GROUP_SIZE, 16, bias=False)
        Int4WeightLinear(lin)(torch.zeros(1, GROUP_SIZE))
        Int8WeightLinear(lin)(torch.zeros(1, GROUP_SIZE))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
