"""`specdec random-model --pair`: a random-weight target and a cheap drafter whose greedy
agreement with it is a knob, for GPU benchmarks on a machine that no real weights can reach.

The two random models of `specdec random-model` are the extremes: a copy of the target
accepts every draft but costs as much as the target, and an unrelated random drafter accepts
none. A real pair sits in between, with a drafter several times cheaper. This module builds one.

Construction
  1. A random Llama of the preset's shape, re-initialized so its greedy outputs are
     non-trivial (`_initialize`): with the default initializer (std 0.02 everywhere) the
     residual stream is the input token's embedding plus layer outputs ~10x smaller, so
     with a tied head every position's argmax is its own input token and greedy decoding
     repeats one token forever. Here every linear has std 1/sqrt(fan_in), so each layer adds
     O(1) to the residual (the later layers have leverage over the logits), the embedding
     has std 0.1 (the input token does not dominate), and q/k have std 2/sqrt(d), so the
     attention logits have std ~4: attention picks a few context positions by content, and
     the next token depends on the context, not only on the last token. A 64-token greedy
     continuation of the tiny preset has 55-62 distinct tokens.
  2. The drafter is the target's first L layers plus the target's final norm, embedding and
     LM head (the same weights). Its logits are those of the residual stream h_L.
  3. The target's layers L.. have their output projections (o_proj, down_proj) scaled by the
     divergence D: they add a D-scaled share to the residual stream. D = 0 makes the
     target's logits exactly the drafter's (greedy agreement 1); growing D lets the later
     layers take over the final norm's direction, and the agreement falls towards 0 (tiny,
     1 of 2 layers: 0.78 at D 0.1, 0.46 at D 0.3, 0.06 at D 1; smollm2-135m, 1 of 30:
     0.77 at D 0.02, 0.24 at D 0.1, 0.05 at D 0.2).
  4. L defaults to the layer count whose weight bytes per decode step (all linears + the LM
     head; one embedding row) are closest to 1/5 of the target's: target-1.5b with a
     49152-token vocabulary gets L = 2 of 16 (ratio ~0.21).

Greedy agreement is measured teacher-forced: the share of positions of a few random token
sequences (4 x 256 by default) where the drafter's argmax equals the target's. It is the
per-position acceptance α of greedy speculative decoding; the accepted share of γ drafts is
lower, (α + α² + ... + α^γ) / γ if positions were independent (pair.json records it for a
few γ). On the tiny preset the agreement on the target's own greedy continuations (what the
services see) is within a few points of the teacher-forced one, slightly above it.

`--acceptance A` finds D by a search on that agreement (`calibrate`: interpolation of
logit(agreement), nearly linear in log D, inside a shrinking bracket; 3-6 forwards). h_L
(the drafter's residual stream, and so its argmax) is computed once; each forward rescales
the later layers' output projections in place and runs only those layers over the batch
(14 layers of 1024 tokens for target-1.5b: milliseconds on a GPU; ~0.15 s for tiny on an
idle 2-core CPU, the LM head's 49152 columns dominating).

Measured on tiny (CPU, float32, seed 0), the asked agreement against the services' accepted
share (5 prompts x 64 greedy tokens; in brackets the independent-positions figure):
  asked 0.2: D 0.58, γ=1 0.18 (0.20), γ=4 0.055 (0.062)
  asked 0.5: D 0.27, γ=1 0.50 (0.50), γ=4 0.235 (0.234)
  asked 0.9: D 0.044, γ=1 0.90 (0.90), γ=4 0.77 (0.78)
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn

from bench.engine import build_model

DRAFTER_BYTES_SHARE = 0.2  # default L: the drafter reads about 1/5 of the target's weight bytes per step
CALIBRATION_SEQUENCES = 4
CALIBRATION_TOKENS = 256
DIVERGENCE_LOG2_RANGE = (-16.0, 8.0)  # the search's bracket of log2 D
BISECTION_STEPS = 12  # forwards at most (a plain bisection would reach log2 D to 24 / 4096: D to 0.4 %)
CALIBRATION_TOLERANCE = 0.005  # finer than the agreement's sampling error at 1024 positions (~0.015)
EMBED_STD = 0.1  # relative to the O(1) layer outputs: the input token must not dominate the residual
QK_GAIN = 2.0  # attention logits of std ~QK_GAIN²: content-dependent attention, not a uniform average


@dataclass(frozen=True)
class PairInfo:
    """What pair.json records."""
    preset: str
    target_layers: int
    drafter_layers: int
    target_bytes_per_step: int  # weights read per decode step: all linears + LM head, one embedding row
    drafter_bytes_per_step: int
    bytes_ratio: float  # drafter / target
    divergence: float
    greedy_agreement: float  # teacher-forced share of positions where the argmaxes agree
    requested_acceptance: float | None  # --acceptance, or None when --divergence was given
    acceptance_rate_at_gamma: dict[str, float]  # accepted / proposed at γ, if positions were independent
    calibration_s: float
    calibration_positions: int
    vocab_size: int
    dtype: str
    device: str
    seed: int
    tokenizer: str


def _initialize(model: nn.Module, seed: int) -> None:
    """Re-draw every weight so greedy outputs depend on the context (module docstring, 1.)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    d = model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD, generator=gen)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj):
                lin.weight.normal_(0.0, QK_GAIN / math.sqrt(d), generator=gen)
            for lin in (attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                lin.weight.normal_(0.0, 1.0 / math.sqrt(lin.in_features), generator=gen)
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, 1.0 / math.sqrt(d), generator=gen)


def weight_bytes_per_step(model: nn.Module, layers: int) -> int:
    """Weight bytes a decode step of the model's first `layers` layers reads: their linears
    and norms, the final norm, the LM head in full, and one embedding row (when untied; a
    tied head is read in full anyway)."""
    elem = next(model.parameters()).element_size()
    params = sum(p.numel() for layer in model.model.layers[:layers] for p in layer.parameters())
    params += model.model.norm.weight.numel() + model.lm_head.weight.numel()
    if not model.config.tie_word_embeddings:
        params += model.config.hidden_size
    return params * elem


def default_drafter_layers(model: nn.Module, share: float = DRAFTER_BYTES_SHARE) -> int:
    """The L in [1, layers - 1] whose bytes per step are closest to `share` of the target's."""
    n = model.config.num_hidden_layers
    if n < 2:
        raise ValueError("a pair needs a target of at least 2 layers")
    target = weight_bytes_per_step(model, n)
    return min(range(1, n), key=lambda L: abs(weight_bytes_per_step(model, L) / target - share))


class _Stop(Exception):
    """Raised by the hook that captures layer L's input, to skip the layers after it."""


class AgreementMeter:
    """Teacher-forced greedy agreement of the pair at a divergence, over fixed random token
    sequences. h_L and the drafter's argmax are computed once; `__call__(D)` rescales the
    later layers' output projections in place and runs only those layers."""

    def __init__(self, model: nn.Module, drafter_layers: int, seed: int,
                 sequences: int = CALIBRATION_SEQUENCES, tokens: int = CALIBRATION_TOKENS) -> None:
        self.model, self.L = model, drafter_layers
        device = next(model.parameters()).device
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(model.config.vocab_size, (sequences, tokens), generator=gen).to(device)  # [S, T]
        self.positions = ids.numel()
        self.tail = nn.ModuleList(list(model.model.layers)[drafter_layers:])
        # The unscaled output projections of the later layers: D multiplies these.
        self.originals = [(layer.self_attn.o_proj.weight.detach().clone(), layer.mlp.down_proj.weight.detach().clone())
                          for layer in self.tail]
        captured: list[torch.Tensor] = []

        def capture(_module, args, kwargs):
            captured.append(args[0] if args else kwargs["hidden_states"])
            raise _Stop

        hook = model.model.layers[drafter_layers].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with torch.inference_mode():
                model(ids, use_cache=False)
        except _Stop:
            pass
        finally:
            hook.remove()
        self.h_L = captured[0]  # [S, T, hidden]: the drafter's last residual stream
        with torch.inference_mode():
            self.draft_argmax = model.lm_head(model.model.norm(self.h_L)).argmax(-1)  # [S, T]

    def scale(self, divergence: float) -> None:
        """Set the later layers' output projections to D × their unscaled weights."""
        with torch.no_grad():
            for layer, (o, down) in zip(self.tail, self.originals):
                layer.self_attn.o_proj.weight.copy_(o * divergence)
                layer.mlp.down_proj.weight.copy_(down * divergence)

    def __call__(self, divergence: float) -> float:
        self.scale(divergence)
        inner = self.model.model
        layers = inner.layers
        inner.layers = self.tail  # the inner model runs the later layers on h_L, then the final norm
        try:
            with torch.inference_mode():
                hidden = inner(inputs_embeds=self.h_L, use_cache=False).last_hidden_state
                target_argmax = self.model.lm_head(hidden).argmax(-1)  # [S, T]
        finally:
            inner.layers = layers
        return float((target_argmax == self.draft_argmax).float().mean())


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)  # agreements of 0 or 1 are measured too
    return math.log(p / (1 - p))


def calibrate(agreement_at: Callable[[float], float], acceptance: float, steps: int = BISECTION_STEPS,
              tolerance: float = CALIBRATION_TOLERANCE) -> tuple[float, float]:
    """The divergence whose agreement is closest to `acceptance` among those tried: a
    safeguarded interpolation search on x = log2 D over DIVERGENCE_LOG2_RANGE (agreement
    falls with D; the D of an agreement spans orders of magnitude across presets: ~0.2 for
    0.6 on tiny, ~0.035 on the 30-layer smollm2-135m). The next x interpolates logit(agreement)
    between the bracket's ends (nearly linear in log D), kept inside the bracket's middle 80 %,
    so the bracket shrinks every step; the midpoint while an end is unmeasured. Stops within
    `tolerance` of `acceptance` (tiny: ~5 forwards instead of 12) or after `steps`.
    Returns (divergence, its agreement)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--acceptance must be in [0, 1], got {acceptance}")
    if acceptance >= 1.0:
        return 0.0, agreement_at(0.0)
    goal = _logit(acceptance)
    lo, hi = DIVERGENCE_LOG2_RANGE  # agreement(2**lo) > acceptance >= agreement(2**hi), presumed
    y_lo: float | None = None
    y_hi: float | None = None
    tried: dict[float, float] = {}
    for _ in range(steps):
        if y_lo is None or y_hi is None or y_lo == y_hi:
            x = (lo + hi) / 2
        else:
            x = lo + (hi - lo) * (y_lo - goal) / (y_lo - y_hi)
            x = min(max(x, lo + 0.1 * (hi - lo)), hi - 0.1 * (hi - lo))
        divergence = 2.0 ** x
        tried[divergence] = agreement_at(divergence)
        if abs(tried[divergence] - acceptance) <= tolerance:
            break
        if tried[divergence] > acceptance:
            lo, y_lo = x, _logit(tried[divergence])
        else:
            hi, y_hi = x, _logit(tried[divergence])
    divergence = min(tried, key=lambda d: abs(tried[d] - acceptance))
    return divergence, tried[divergence]


def acceptance_rate_at_gamma(agreement: float, gammas: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, float]:
    """Accepted / proposed drafts at γ if each position agreed independently with
    probability `agreement`: a round accepts the drafts before the first disagreement."""
    return {str(g): sum(agreement ** k for k in range(1, g + 1)) / g for g in gammas}


def save_pair(preset: str, out: str, *, drafter_layers: int | None = None, divergence: float | None = None,
              acceptance: float | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
              device: str = "cpu", tokenizer: str = "embedded") -> PairInfo:
    """Write out/target, out/drafter (model directories the services load with --model,
    the same tokenizer files) and out/pair.json. Exactly one of `divergence` and
    `acceptance` (a greedy agreement to calibrate the divergence for) is given."""
    from specdec.models import ModelSpec, load_tokenizer

    if (divergence is None) == (acceptance is None):
        raise ValueError("give exactly one of --divergence and --acceptance")
    if divergence is not None and divergence < 0:
        raise ValueError(f"--divergence must be >= 0, got {divergence}")
    tok = load_tokenizer(ModelSpec(model=tokenizer))
    model = build_model(preset, dtype, torch.device(device), max_len=4096, seed=seed, vocab_size=len(tok))
    _initialize(model, seed)
    n = model.config.num_hidden_layers
    L = default_drafter_layers(model) if drafter_layers is None else drafter_layers
    if not 1 <= L < n:
        raise ValueError(f"--drafter-layers must be in [1, {n - 1}] for {preset} ({n} layers), got {L}")
    target_bytes, drafter_bytes = weight_bytes_per_step(model, n), weight_bytes_per_step(model, L)

    t0 = time.perf_counter()
    meter = AgreementMeter(model, L, seed)
    if acceptance is not None:
        divergence, agreement = calibrate(meter, acceptance)
    else:
        agreement = meter(divergence)
    meter.scale(divergence)  # the target is saved with the chosen divergence
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    calibration_s = time.perf_counter() - t0

    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(os.path.join(out, "target"))
    tok.save_pretrained(os.path.join(out, "target"))
    # The drafter: the same model cut to its first L layers (embedding, final norm, head shared).
    model.model.layers = nn.ModuleList(list(model.model.layers)[:L])
    model.config.num_hidden_layers = L
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:L]
    model.save_pretrained(os.path.join(out, "drafter"))
    tok.save_pretrained(os.path.join(out, "drafter"))

    info = PairInfo(preset=preset, target_layers=n, drafter_layers=L, target_bytes_per_step=target_bytes,
                    drafter_bytes_per_step=drafter_bytes, bytes_ratio=drafter_bytes / target_bytes,
                    divergence=divergence, greedy_agreement=agreement, requested_acceptance=acceptance,
                    acceptance_rate_at_gamma=acceptance_rate_at_gamma(agreement), calibration_s=calibration_s,
                    calibration_positions=meter.positions, vocab_size=model.config.vocab_size,
                    dtype=str(dtype).removeprefix("torch."), device=device, seed=seed, tokenizer=tokenizer)
    with open(os.path.join(out, "pair.json"), "w") as f:
        json.dump(asdict(info), f, indent=2)
    return info
