"""`specdec bench peer`: our services against transformers' assisted generation.

The same prompts, the same model pair (fp32 target, float16 drafter of the embedded
weights), greedy, `max_tokens` each, measured four ways:
- ours over gRPC, speculative (one row per γ) and target-only;
- HF assisted generation in this process: `target.generate(..., assistant_model=draft,
  do_sample=False)` with the assistant's `num_assistant_tokens = γ`,
  `num_assistant_tokens_schedule = "constant"` and `assistant_confidence_threshold = 0`
  (HF's default 0.4 stops a draft early when the assistant is unsure; ours always
  drafts γ, so the comparison fixes γ on both sides);
- HF `target.generate(do_sample=False)`.
CPU contention: the phases run one after the other. Our services are measured first;
they are idle (between requests) while this process runs the HF models, whose torch
thread count is set explicitly (`--threads`). tokens/s = generated tokens / wall time,
summed over the prompts, after one warm-up call per configuration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from bench.datasets import interleave, load_dataset
from bench.serve import WARMUP_MAX_TOKENS, encode
from client.launcher import start_services
from client.speculative import SpeculativeClient
from specdec.models import EMBEDDED, EMBEDDED_NAME
from specdec.sampling import SamplingParams


@dataclass(frozen=True)
class PeerRow:
    system: str
    gamma: int | None
    tokens: int
    seconds: float
    outputs: tuple[tuple[int, ...], ...]  # generated ids of each prompt
    acceptance_rate: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _measure(system: str, gamma: int | None, prompts: Sequence[list[int]],
             run: Callable[[list[int]], tuple[list[int], float, tuple[int, int]]]) -> PeerRow:
    """run(prompt ids) -> (generated ids, seconds, (drafted, accepted))."""
    outputs, seconds, drafted, accepted = [], 0.0, 0, 0
    for ids in prompts:
        out, dt, (d, a) = run(ids)
        outputs.append(tuple(out))
        seconds += dt
        drafted += d
        accepted += a
    return PeerRow(system, gamma, sum(len(o) for o in outputs), seconds, tuple(outputs),
                   accepted / drafted if drafted else None)


def measure_ours(client: SpeculativeClient, prompts: Sequence[list[int]], max_tokens: int,
                 gammas: Sequence[int]) -> list[PeerRow]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def runner(gamma: int):
        def run(ids: list[int]):
            r = client.generate(ids, params, num_speculative_tokens=gamma, target_only=gamma == 0)
            return r.token_ids, r.elapsed_s, (r.num_draft_tokens, r.num_accepted_tokens)

        return run

    rows = []
    for gamma in [0, *gammas]:
        client.generate(prompts[0], params.replace(max_tokens=WARMUP_MAX_TOKENS), num_speculative_tokens=gamma,
                        target_only=gamma == 0)
        name = "specdec gRPC target-only" if gamma == 0 else "specdec gRPC speculative"
        rows.append(_measure(name, gamma or None, prompts, runner(gamma)))
    return rows


def measure_hf(prompts: Sequence[list[int]], max_tokens: int, gammas: Sequence[int], eos_ids: Sequence[int],
               threads: int) -> list[PeerRow]:
    import torch

    from specdec.models import CausalLM, ModelSpec

    torch.set_num_threads(threads)  # deliberate: this process shares the cores with the idle services
    target = CausalLM(ModelSpec(dtype="float32")).model
    draft = CausalLM(ModelSpec(dtype="float16")).model
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    @torch.inference_mode()
    def generate(ids: list[int], new_tokens: int, gamma: int):
        input_ids = torch.tensor([ids], dtype=torch.long)
        kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "attention_mask": torch.ones_like(input_ids),
                  "eos_token_id": list(eos_ids), "pad_token_id": eos_ids[0]}
        if gamma:
            draft.generation_config.num_assistant_tokens = gamma
            kwargs.update(assistant_model=draft, num_assistant_tokens=gamma)
        start = time.perf_counter()
        out = target.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        # HF pads nothing for a single sequence, but cut at the first EOS as our client does.
        for i, tok in enumerate(new):
            if tok in eos_ids:
                new = new[: i + 1]
                break
        return new, seconds, (0, 0)

    rows = []
    for gamma in [0, *gammas]:
        generate(prompts[0], WARMUP_MAX_TOKENS, gamma)
        name = "HF target-only" if gamma == 0 else "HF assisted generation"
        rows.append(_measure(name, gamma or None, prompts, lambda ids, g=gamma: generate(ids, max_tokens, g)))
    return rows


def run_peer(*, dataset: str, num_prompts: int, max_tokens: int, gammas: Sequence[int], seed: int, chat: bool,
             threads: int, service_threads: int, drafter: str | None = None, verifier: str | None = None) -> dict:
    chosen = interleave(load_dataset(dataset), seed)
    chosen = [chosen[i % len(chosen)] for i in range(num_prompts)]
    services = []
    try:
        if not (drafter and verifier):
            services.extend(start_services([("drafter", ["--log-level", "WARNING"]),
                                            ("verifier", ["--log-level", "WARNING"])], threads=service_threads))
            drafter, verifier = services[0].address, services[1].address
        with SpeculativeClient(verifier, drafter=drafter, num_speculative_tokens=max(gammas)) as client:
            if client.drafter_info is None:
                raise ValueError(f"the drafter at {drafter} does not answer")
            # The HF side runs the embedded pair: against services of other models the speedups
            # and the "same as HF" counts compared different models.
            embedded = f"{EMBEDDED}:{EMBEDDED_NAME}["
            for role, info in (("verifier", client.verifier_info), ("drafter", client.drafter_info)):
                if not info.model.startswith(embedded):
                    raise ValueError(f"bench peer compares with HF transformers running the embedded models; the "
                                     f"{role} at {verifier if role == 'verifier' else drafter} serves "
                                     f"{info.model}: start the services with --model embedded, or drop --drafter "
                                     "and --verifier to have bench peer start them")
            prompts = [encode(client, p, chat) for p in chosen]
            cap = min(client.drafter_info.max_draft_tokens, client.verifier_info.max_draft_tokens)
            if max(gammas) > cap:
                raise ValueError(f"--num-speculative-tokens {max(gammas)} exceeds the services' max_draft_tokens {cap}")
            rows = measure_ours(client, prompts, max_tokens, gammas)
            eos_ids = list(client.verifier_info.eos_token_ids)
        rows += measure_hf(prompts, max_tokens, gammas, eos_ids, threads)
    finally:
        for s in reversed(services):
            s.stop()
    reference = next(r for r in rows if r.system == "HF target-only")
    return {
        "dataset": dataset,
        "prompt_ids": [p.id for p in chosen],
        "max_tokens": max_tokens,
        "chat": chat,
        "threads": threads,
        "services": "started here" if services else {"drafter": drafter, "verifier": verifier},
        "service_threads": service_threads if services else None,
        "rows": [
            {"system": r.system, "num_speculative_tokens": r.gamma, "tokens": r.tokens, "seconds": r.seconds,
             "tokens_per_s": r.tokens_per_s, "acceptance_rate": r.acceptance_rate,
             "speedup_vs_hf_target": r.tokens_per_s / reference.tokens_per_s if reference.tokens_per_s else None,
             "prompts_identical_to_hf_target": sum(a == b for a, b in zip(r.outputs, reference.outputs))}
            for r in rows
        ],
    }


def format_peer(result: dict) -> str:
    n = len(result["prompt_ids"])
    header = (f"{'system':<26}{'gamma':>6}{'tokens':>8}{'time s':>9}{'tok/s':>8}{'vs HF target':>13}"
              f"{'accept':>8}{'same as HF target':>19}")
    lines = [header, "-" * len(header)]
    for r in result["rows"]:
        gamma = "-" if r["num_speculative_tokens"] is None else str(r["num_speculative_tokens"])
        accept = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        speedup = "n/a" if r["speedup_vs_hf_target"] is None else f"{r['speedup_vs_hf_target']:.2f}x"
        lines.append(f"{r['system']:<26}{gamma:>6}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_s']:>8.2f}"
                     f"{speedup:>13}{accept:>8}"
                     f"{str(r['prompts_identical_to_hf_target']) + '/' + str(n):>19}")
    return "\n".join(lines)
