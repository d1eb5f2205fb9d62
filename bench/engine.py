"""`specdec bench engine`: ms per forward step of eager transformers against our fast path
(static slot pool + CUDA graphs, static_forward.py), on random-weight Llama configs of
realistic size, beside the memory-bandwidth limit of the step.

No weights can be carried to a GPU machine, so the models are built with `from_config`
(seeded, so two builds are the same model). One step appends `width` tokens to each of B
sessions that already hold `context` positions (a verify of γ+1 tokens, or a decode of 1),
then the caches are cut back, so every timed step sees the same lengths. The baseline is
transformers' own forward with a DynamicCache (`cache.crop` back after each step); the fast
path runs `StaticForward` over B pool slots; our eager slot forward (what the services run
without the fast path) is measured too. Both get the same token ids; the greedy
agreement of their logits is printed as the GPU check of "same greedy tokens".

Bytes per step = the weights read by the step (the input embedding only for the rows it
looks up, the LM head in full) + the KV cache read by attention (B × (context + width)
positions). The limit is bytes / peak bandwidth; achieved GB/s = bytes / measured time,
as gpt-fast prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from specdec.argtypes import device as device_arg, output_file, positive as _positive, positive_list
from specdec.slot_forward import Row, SlotForward
from specdec.static_forward import PIECE_WIDTH, WIDTH_BUCKETS, StaticForward

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
PRESETS: dict[str, dict] = {
    # the verifier: ~1.5B parameters, 3 GB in bfloat16
    "target-1.5b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, **_LLAMA3),
    # the drafter: ~270M parameters
    "drafter-270m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                         intermediate_size=2048, **_LLAMA3),
    # the embedded default's shape (SmolLM2-135M)
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    # for tests: seconds on a CPU
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}
DEFAULT_WIDTH = {"target-1.5b": 5}  # verify γ+1 = 5 tokens; the others decode 1
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L4": 300.0}  # HBM / GDDR peak by device name


def build_model(preset: str, dtype: torch.dtype, device: torch.device, max_len: int, seed: int = 0,
                vocab_size: int | None = None):
    """A random-weight LlamaForCausalLM of `preset`'s shape (the same weights for the same seed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    shape = {**PRESETS[preset], **({"vocab_size": vocab_size} if vocab_size else {})}
    config = LlamaConfig(**shape, max_position_embeddings=max_len)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):  # initialize on the device: seconds instead of a minute on the host
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_random_model(preset: str, out: str, tokenizer: str = "embedded", seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> int:
    """Write a random-weight model of `preset`'s shape, with `tokenizer`'s vocabulary and
    files, as a local HF directory the services load with `--model DIR` (end-to-end runs on
    a GPU machine that no weights can reach). The same preset and seed give the same
    weights, so a drafter built like its verifier accepts every draft (the ceiling).
    Returns the parameter count."""
    from specdec.models import ModelSpec, load_tokenizer

    tok = load_tokenizer(ModelSpec(model=tokenizer))
    model = build_model(preset, dtype, torch.device(device), max_len=4096, seed=seed, vocab_size=len(tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def step_bytes(model, batch: int, context: int, width: int) -> int:
    """Bytes a step must read at least: weights (embedding rows only) + the KV of every row."""
    cfg = model.config
    elem = next(model.parameters()).element_size()
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    weights = sum(p.numel() for p in model.parameters()) * elem
    if not tied:  # the input embedding is looked up, not read in full
        weights -= embed.numel() * elem - batch * width * cfg.hidden_size * elem
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    return weights + batch * (context + width) * kv_per_token


@dataclass(frozen=True)
class EngineRow:
    preset: str
    batch: int
    width: int
    context: int
    eager_ms: float
    slot_ms: float  # our eager slot forward (per-row attention): the services' path without --fast-path
    fast_ms: float
    bytes_per_step: int
    limit_ms: float | None
    greedy_agreement: float  # share of positions whose argmax is the same in both paths
    max_logit_diff: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.fast_ms

    def gbps(self, ms: float) -> float:
        return self.bytes_per_step / ms / 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(step, device: torch.device, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_eager(model, prompt: torch.Tensor, step_ids: torch.Tensor, device: torch.device, steps: int,
                warmup: int) -> tuple[float, torch.Tensor]:
    """transformers' forward with a DynamicCache: (median ms per step, the step's logits [B, width, V])."""
    from transformers import DynamicCache

    width = step_ids.shape[1]
    cache = DynamicCache(config=model.config)
    model(prompt.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step() -> torch.Tensor:
        logits = model(step_ids.to(device), past_key_values=cache, use_cache=True).logits
        cache.crop(-width)  # transformers 5: a negative count drops that many tokens
        return logits

    logits = step()
    return _median_ms(step, device, steps, warmup), logits


def _time_slots(forward, slots: list, prompt: torch.Tensor, step_ids: torch.Tensor, device: torch.device,
                steps: int, warmup: int) -> tuple[float, object]:
    """`forward` (a slot forward) over `slots`: each prefilled with its prompt row (one row
    at a time, so the prefill's activations stay those of one row), then steps appending
    step_ids from the prompt's length. (median ms per step, the step's output)."""
    context, width = prompt.shape[1], step_ids.shape[1]
    for b, slot in enumerate(slots):
        forward([Row(slot, prompt[b].tolist(), keep=1)])
    rows = [Row(slot, step_ids[b].tolist(), keep=width) for b, slot in enumerate(slots)]

    def step():
        for slot in slots:
            slot.length = context
        return forward(rows)

    out = step()
    return _median_ms(step, device, steps, warmup), out


@torch.inference_mode()
def measure(model, preset: str, batch: int, context: int, width: int, steps: int, warmup: int,
            peak_gbps: float | None, seed: int = 0) -> EngineRow:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (batch, context), generator=gen)  # [B, context]
    step_ids = torch.randint(vocab, (batch, width), generator=gen)  # [B, width]
    eager_ms, eager_logits = _time_eager(model, prompt, step_ids, device, steps, warmup)
    slots = SlotForward(model, max_len=context + max(width, 32))
    slot_ms, _ = _time_slots(slots.forward, [slots.new_slot() for _ in range(batch)], prompt, step_ids, device,
                             steps, warmup)
    # A width past the widest bucket is a prompt chunk: the fast path runs it as pieces of
    # PIECE_WIDTH tokens, all of the step's pieces in one static step (as a service's would).
    pieces = -(-width // PIECE_WIDTH) if width > WIDTH_BUCKETS[-1] else 1
    fast = StaticForward(slots, slots.new_pool(batch), max_batch=batch * pieces,
                         max_width=min(width, WIDTH_BUCKETS[-1]))
    fast_ms, out = _time_slots(fast.forward, [fast.pool.acquire() for _ in range(batch)], prompt, step_ids, device,
                               steps, warmup)
    fast_logits = torch.stack(out)  # [B, width, V] float32
    agreement = float((fast_logits.argmax(-1) == eager_logits.float().argmax(-1)).float().mean())
    diff = float((fast_logits - eager_logits.float()).abs().max())
    nbytes = step_bytes(model, batch, context, width)
    return EngineRow(preset=preset, batch=batch, width=width, context=context, eager_ms=eager_ms, slot_ms=slot_ms,
                     fast_ms=fast_ms,
                     bytes_per_step=nbytes, limit_ms=nbytes / (peak_gbps * 1e6) if peak_gbps else None,
                     greedy_agreement=agreement, max_logit_diff=diff)


def peak_bandwidth(device: torch.device, given: float | None) -> float | None:
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def format_rows(rows: list[EngineRow], graphs: bool) -> str:
    fast_name = "fast ms" + ("" if graphs else "*")
    header = (f"{'preset':<14}{'B':>4}{'T':>3}{'eager ms':>10}{'slots ms':>10}{fast_name:>10}{'speedup':>9}{'MB/step':>9}"
              f"{'limit ms':>10}{'fast/limit':>11}{'fast GB/s':>11}{'greedy=':>9}{'max|dlogit|':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = f"{r.fast_ms / r.limit_ms:.1f}x" if r.limit_ms else "-"
        limit = f"{r.limit_ms:.3f}" if r.limit_ms else "-"
        lines.append(f"{r.preset:<14}{r.batch:>4}{r.width:>3}{r.eager_ms:>10.2f}{r.slot_ms:>10.2f}{r.fast_ms:>10.2f}{r.speedup:>8.2f}x"
                     f"{r.bytes_per_step / 1e6:>9.0f}{limit:>10}{ratio:>11}{r.gbps(r.fast_ms):>11.1f}"
                     f"{r.greedy_agreement:>9.3f}{r.max_logit_diff:>12.2e}")
    lines.append("T: tokens per row and step (verify γ+1 or decode 1); eager: transformers with a DynamicCache; "
                 "slots: our eager slot forward (the path without --fast-path); speedup: eager / fast; limit: bytes / "
                 "peak bandwidth; greedy=: share of positions whose argmax matches eager transformers")
    if not graphs:
        lines.append("* no CUDA: the fast path's static step runs eagerly (no graphs); its figures are not the GPU's")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    unknown = [p for p in args.preset if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown preset {unknown[0]!r}; choose from {', '.join(PRESETS)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    peak = peak_bandwidth(device, args.peak_gbps)
    batches = args.batch_sizes
    rows = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, {dtype}, context {args.context}, peak bandwidth "
          f"{f'{peak:.0f} GB/s' if peak else 'unknown (--peak-gbps)'}, torch threads {torch.get_num_threads()}")
    for preset in args.preset:
        width = args.width or DEFAULT_WIDTH.get(preset, 1)
        model = build_model(preset, dtype, device, max_len=args.context + max(width, 32))
        params = sum(p.numel() for p in model.parameters())
        print(f"{preset}: {params / 1e6:.0f}M parameters, {params * next(model.parameters()).element_size() / 1e9:.2f} GB")
        for batch in batches:
            rows.append(measure(model, preset, batch, args.context, width, args.steps, args.warmup, peak))
            r = rows[-1]
            print(f"  B={batch}: eager {r.eager_ms:.2f} ms, slots {r.slot_ms:.2f} ms, fast {r.fast_ms:.2f} ms", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(format_rows(rows, graphs=device.type == "cuda"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": str(dtype), "peak_gbps": peak,
                       "rows": [{**asdict(r), "speedup": r.speedup} for r in rows]}, f, indent=2)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", action="append", required=True,
                   help="random-weight Llama shape: target-1.5b, drafter-270m, smollm2-135m, tiny; repeat for several")
    p.add_argument("--device", type=device_arg(auto=True), default="auto",
                   help="cpu, cuda[:N], or auto (cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", type=positive_list("--batch-sizes"), default=[1, 16, 64], help="comma-separated")
    p.add_argument("--context", type=_positive("--context"), default=512,
                   help="positions each session holds before the step")
    p.add_argument("--width", type=_positive("--width"), default=None,
                   help="tokens per row and step (default 5, a verify of gamma 4, for target-1.5b; else 1)")
    p.add_argument("--steps", type=_positive("--steps"), default=20)
    p.add_argument("--warmup", type=_positive("--warmup", zero=True), default=3)
    p.add_argument("--peak-gbps", type=_positive("--peak-gbps", float), default=None,
                   help="memory bandwidth for the limit (default: by GPU name)")
    p.add_argument("--json", type=output_file, default=None, help="also write the rows to this path")


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.engine ...`: the same as `specdec bench engine`, without the
    client's imports (grpc), for a GPU machine that has only torch and transformers."""
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
