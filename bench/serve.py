"""`specdec bench serve`: a vLLM-style serving benchmark of the drafter + verifier pair.

Workload. N prompts (see `datasets.py`) are sent as tasks of one event loop, each through
`SpeculativeClient.astream` (as vLLM's `bench serve` drives its server); arrival times
follow a Poisson process of `request_rate` requests/s (Gamma inter-arrivals with shape
`burstiness` as in vLLM; burstiness 1 is Poisson, `inf` sends everything at once), and
`max_concurrency` bounds the requests in flight (a request that arrives while all slots
are busy waits for one; its latencies are measured from when it is actually sent, as vLLM
does). Prompts are tokenized once, before the run. `duration_limit_s` is a hard bound:
requests not yet sent are recorded as failed ("not sent"), and requests in flight stop
after their current round ("aborted").

Metrics follow vLLM's `benchmarks/serve.py` names and definitions:
- TTFT: from sending the request to the first streamed chunk (the first round's tokens).
- E2EL: from sending the request to its last chunk.
- TPOT: (e2el - ttft) / (output_tokens - 1) per request; one-token outputs have none.
  vLLM's formula. Our first chunk can carry up to γ + 1 tokens whose time falls in TTFT, so a
  speculative run's TPOT reads low against target-only by at most γ / (output_tokens - 1).
- ITL: one gap per streamed chunk after the first. Each speculative round is one chunk
  carrying all the tokens it committed, and, as vLLM does for multi-token chunks, it
  counts as ONE gap (not k gaps of which k - 1 are zero). ITL is thus the time per
  round; TPOT is the per-token figure.
- throughputs divide by the run's duration (first send to last completion);
  `total_token_throughput` counts input + output tokens.
- goodput (vLLM's `--goodput ttft:MS tpot:MS e2el:MS`): completed requests meeting
  every given SLO, per second.
- per request, vLLM's arrays `input_lens`, `output_lens`, `ttfts`, `itls` and `errors`.
Ours: `acceptance_rate` (accepted / proposed drafts), `mean_accepted_tokens_per_round`
(accepted drafts per round, bonus token excluded), `mean_rounds_per_request`, and per
round of each request `accepted_per_round` (the tokens its chunk carries minus one, 0 for a
round without drafts; a round cut short by EOS counts only the tokens kept) and `drafts_per_round` (as the client
reports them: 0 for the first round and for every target-only round), plus
`speculative_round_share` (rounds that drafted / all rounds) and `mean_drafts_per_round`
(the mean γ over all rounds, the γ of the ideal-speedup model below), and
`drafter_fallback_round_share` (rounds run without drafts because no drafter answered: past 0,
the run is partly target-only, and says so).

Against the engines. Every reply carries the engine step's load (EngineLoad): `device_ms`
(the forward and the sampler on the device) of the verifier step that served a round, and
the drafter's device ms per draft step. Per mode:
- `mean_verify_device_ms_per_round`, `mean_verify_step_ms_per_round` (the engine step's wall
  time), `mean_verify_host_ms_per_round` (the client-measured Verify time minus the device
  time: engine host work, queueing, gRPC, client) and `mean_draft_device_ms_per_round`;
- `engine_tokens_per_request_s`: output tokens / the device time of the rounds that
  produced them (verify + draft steps), summed over requests as `output_tokens_per_request_s`
  sums latencies: what the engines' own steps allow a request;
- `engine_efficiency` = `output_tokens_per_request_s` / `engine_tokens_per_request_s`
  (<= ~1; it falls as host cost, queueing and the wire grow).
Against a target-only run of the same workload: measured speedup = the ratio of
`output_tokens_per_request_s` (output tokens / summed request latency: meaningful per
category and at a finite request rate, where the run's throughput ratio would be ~1);
ideal speedup = the ratio of `engine_tokens_per_request_s` (from the engines' device times,
never from measured latencies); `system_efficiency` = measured / ideal speedup (the key kept,
its meaning new: before, the ideal came from the client-measured call costs and could not
fall below ~1). Null without a target-only run, or when a service reports no device time.

Per-category metrics use the whole run's duration, so a category's throughput is its
share of the run's throughput (the categories add up to the total).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Sequence

import grpc
import numpy as np

from bench.datasets import RANDOM, SHIPPED, BenchPrompt, RandomDataset, interleave, load_dataset
from client.pool import parse_addresses
from client.speculative import AUTO, SpeculativeClient, shares_device
from specdec.argtypes import DEFAULT_DECODE_STEPS
from specdec.sampling import SamplingParams, mix64
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import CHANNEL_OPTIONS
from specdec_rpc.ops import TLSFiles, open_channel

log = logging.getLogger(__name__)

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
WARMUP_MAX_TOKENS = 4


@dataclass(frozen=True)
class WorkloadConfig:
    verifier: str  # HOST:PORT, or several comma-separated: a pool
    drafter: str | None = None
    dataset: str = SHIPPED
    random_dataset: RandomDataset = RandomDataset()  # --dataset random's lengths
    num_prompts: int = 24
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    params: SamplingParams = SamplingParams(temperature=0.0, max_tokens=64)
    num_speculative_tokens: int | str = AUTO  # or a fixed γ
    fanout: int = 0  # speculation cache
    decode_steps: int = DEFAULT_DECODE_STEPS  # target-only steps a round without drafts may run
    chat: bool = True
    target_only: bool = False
    timeout_s: float = 60.0
    duration_limit_s: float | None = None
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    # vLLM's --metric-percentiles (added to the p90 / p99 every result has) and --percentile-metrics
    # (the latencies whose percentiles are printed; the JSON has every one)
    metric_percentiles: tuple[float, ...] = ()
    percentile_metrics: tuple[str, ...] = LATENCY_METRICS
    warmup_requests: int = 1
    show_progress: bool = True
    tls: TLSFiles = TLSFiles()  # the services' TLS (any file: TLS on) and bearer token
    auth_token: str | None = None

    def client_security(self) -> dict:
        """SpeculativeClient's keyword arguments for `tls` and `auth_token`."""
        return dict(tls_ca=self.tls.ca, tls_cert=self.tls.cert, tls_key=self.tls.key, auth_token=self.auth_token)

    def replace(self, **changes) -> "WorkloadConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: BenchPrompt
    prompt_ids: tuple[int, ...]


@dataclass
class RequestRecord:
    """What one request measured; times in seconds (vLLM's per-request units)."""

    index: int
    category: str
    prompt_id: str
    input_tokens: int
    output_tokens: int = 0
    start: float | None = None  # when it was sent, from the start of the run
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)  # one gap per chunk (round) after the first
    rounds: int = 0
    speculative_rounds: int | None = 0  # rounds that verified at least one draft; None: the server did not say
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafts_per_round: list[int] = field(default_factory=list)  # the client's γ of each round
    draft_time: float = 0.0  # client-measured time in Draft calls
    cached_draft_tokens: int = 0  # drafts that came from the drafter's speculation cache
    verify_time: float = 0.0  # client-measured time in Verify calls
    # Engine time behind those calls, as the services reported it (EngineLoad, see the docstring).
    verify_device_time: float = 0.0
    verify_step_time: float = 0.0
    draft_device_time: float = 0.0
    drafter_fallback_rounds: int = 0  # rounds run without drafts because no drafter was reachable
    drafters: list[str] = field(default_factory=list)  # servers its sessions were on (pools), in order
    verifiers: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# ---- arrivals -----------------------------------------------------------------------


def inter_arrival_times(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """[n] gaps in seconds between successive sends: Gamma(shape=burstiness,
    scale=1/(rate·burstiness)), mean 1/rate; burstiness 1 is Exponential(rate), i.e.
    Poisson arrivals. rate = inf gives zeros (everything at once)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf sends all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """[n] send times from the start of the run; the first request goes at 0."""
    gaps = inter_arrival_times(n, rate, seed, burstiness)
    if n:
        gaps[0] = 0.0
    return np.cumsum(gaps)


# ---- server counters ----------------------------------------------------------------


def server_stats(address: str, role: str, timeout_s: float = 10.0, *, tls: TLSFiles = TLSFiles(),
                 auth_token: str | None = None) -> dict[str, int | str] | None:
    """The service's own counters (GetStats), or None if it cannot tell."""
    stub_class = pb_grpc.DrafterStub if role == "drafter" else pb_grpc.VerifierStub
    with open_channel(address, tls=tls, auth_token=auth_token, options=CHANNEL_OPTIONS) as channel:
        try:
            msg = stub_class(channel).GetStats(pb.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            log.warning("GetStats on %s %s failed: %s", role, address, exc.code())
            return None
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def pool_stats(addresses: str, role: str, timeout_s: float = 10.0, **security) -> dict | None:
    """`server_stats` of one server, or summed over a pool (comma-separated addresses) with
    each server's own under "servers"; None if any of them cannot tell. security: tls, auth_token."""
    per_server = {a: server_stats(a, role, timeout_s, **security) for a in parse_addresses(addresses, role)}
    if any(stats is None for stats in per_server.values()):
        return None
    if len(per_server) == 1:
        return next(iter(per_server.values()))
    total: dict = {"role": role}
    for stats in per_server.values():
        for k, v in stats.items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    total["servers"] = per_server
    return total


def _stats_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {k: v - before[k] for k, v in after.items() if isinstance(v, int) and k in before}


# ---- requests -----------------------------------------------------------------------


def encode(client: SpeculativeClient, prompt: BenchPrompt, chat: bool) -> list[int]:
    return client.encode_chat(prompt.chat_messages()) if chat else client.encode_prompt(prompt.text)


def build_requests(client: SpeculativeClient, config: WorkloadConfig) -> list[BenchRequest]:
    """num_prompts requests from the dataset in a seeded, category-interleaved order,
    cycling when it has fewer; prompts too long for the context are skipped."""
    if config.dataset == RANDOM:
        return _random_requests(client, config)
    prompts = interleave(load_dataset(config.dataset), config.seed)
    limit = client.verifier_info.max_context - config.params.max_tokens
    encoded = []
    for p in prompts:
        ids = encode(client, p, config.chat)
        if 0 < len(ids) <= limit:
            encoded.append((p, tuple(ids)))
    if not encoded:
        raise ValueError(f"no prompt of {config.dataset} fits the context with max_tokens={config.params.max_tokens}")
    if len(encoded) < len(prompts):
        log.warning("skipped %d prompts longer than %d tokens", len(prompts) - len(encoded), limit)
    warn_if_cycled(len(encoded), config)
    return [BenchRequest(i, *encoded[i % len(encoded)]) for i in range(config.num_prompts)]


def warn_if_cycled(available: int, config: WorkloadConfig) -> None:
    """More requests than prompts: some are sent again (vLLM oversamples too, and says so)."""
    if available < config.num_prompts:
        log.warning("%s has %d usable prompts for --num-prompts %d: they are sent again in the same order to make "
                    "up the number", config.dataset, available, config.num_prompts)


def _random_requests(client: SpeculativeClient, config: WorkloadConfig) -> list[BenchRequest]:
    """vLLM's random dataset, drawn from the tokenizer's ids (the same in target-only and
    speculative runs, which must send the same prompts)."""
    spec, context = config.random_dataset, client.verifier_info.max_context
    if spec.longest() > context:
        raise ValueError(f"--dataset random: a request may need {spec.longest()} tokens (prefix + input and output "
                         f"at their longest), past the verifier's context of {context}")
    vocab = min(client.verifier_info.vocab_size, len(client.tokenizer))
    prompts = spec.prompts(config.num_prompts, vocab, config.seed)
    return [BenchRequest(i, p, p.token_ids) for i, p in enumerate(prompts)]


def request_params(config: WorkloadConfig, req: BenchRequest) -> SamplingParams:
    """Random sampling gets a per-request seed derived from --seed, so runs repeat; the random
    dataset's requests have their own output lengths."""
    params = config.params
    if req.prompt.max_tokens is not None:
        params = params.replace(max_tokens=req.prompt.max_tokens)
    if params.greedy:
        return params
    return params.replace(seed=mix64(config.seed, req.index))


class _Aborted(Exception):
    pass


async def send_request(client: SpeculativeClient, req: BenchRequest, config: WorkloadConfig, gamma: int | str,
                       run_start: float, deadline: float | None) -> RequestRecord:
    rec = RequestRecord(index=req.index, category=req.prompt.category, prompt_id=req.prompt.id,
                        input_tokens=len(req.prompt_ids))
    if deadline is not None and time.perf_counter() >= deadline:
        rec.error = "not sent: duration limit reached"
        return rec
    params = request_params(config, req)
    sent = last = time.perf_counter()
    rec.start = sent - run_start
    stream = client.astream(list(req.prompt_ids), params, num_speculative_tokens=gamma,
                            target_only=config.target_only, fanout=config.fanout)
    result = None
    emitted = 0
    try:
        async for chunk in stream:
            now = time.perf_counter()
            if rec.ttft is None:
                rec.ttft = now - sent
            else:
                rec.itl.append(now - last)
            last = now
            if not config.target_only:
                rec.accepted_per_round.append(max(len(chunk.token_ids) - 1, 0))
            emitted += len(chunk.token_ids)
            result = chunk.result
            if result is None and deadline is not None and now >= deadline:
                raise _Aborted
    except _Aborted:
        rec.error = "aborted: duration limit reached"
    except grpc.RpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    except Exception as exc:  # recorded per request, like vLLM's failed requests
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        await stream.aclose()  # closes both sessions now, also when aborted
    if result is None:
        rec.error = rec.error or "stream ended without a result"
        return rec
    rec.e2el = last - sent
    rec.output_tokens = len(result.token_ids)
    rec.rounds = result.num_rounds
    rec.speculative_rounds = result.num_speculative_rounds
    rec.draft_tokens = result.num_draft_tokens
    rec.accepted_tokens = result.num_accepted_tokens
    if not config.target_only:
        rec.drafts_per_round = list(result.gamma_per_round)
        # A round without drafts accepts none, though a decode_steps round's chunk carries several tokens.
        rec.accepted_per_round = [a if g else 0 for a, g in zip(rec.accepted_per_round, rec.drafts_per_round)]
    rec.cached_draft_tokens = result.cached_draft_tokens
    rec.draft_time = result.draft_time_s
    rec.verify_time = result.verify_time_s
    rec.verify_device_time = getattr(result, "verify_device_s", 0.0)  # 0 from a client without engine times
    rec.verify_step_time = getattr(result, "verify_step_s", 0.0)
    rec.draft_device_time = getattr(result, "draft_device_s", 0.0)
    rec.drafter_fallback_rounds = result.drafter_fallback_rounds
    rec.drafters, rec.verifiers = list(result.drafter_addresses), list(result.verifier_addresses)
    rec.finish_reason = result.finish_reason
    return rec


def dispatch(client: SpeculativeClient, requests: Sequence[BenchRequest], config: WorkloadConfig,
             gamma: int, send=None) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; returns the records (in request order)
    and the run's duration in seconds. Requests are tasks on one event loop (`send_request`);
    another backend passes its own blocking `send(client, req, config, gamma, run_start,
    deadline)`, which then runs on a thread per request in flight (bench/openai_backend.py)."""
    return asyncio.run(_dispatch(client, requests, config, gamma, send))


async def _dispatch(client, requests: Sequence[BenchRequest], config: WorkloadConfig, gamma: int,
                    send) -> tuple[list[RequestRecord], float]:
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed, config.burstiness)
    workers = max(1, min(len(requests), config.max_concurrency or len(requests)))
    slots = asyncio.Semaphore(workers)  # max_concurrency: an arrival waits for a slot, then is sent
    progress = _progress(len(requests), config)
    ends: list[float] = []
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") if send is not None else None

    async def one(req: BenchRequest) -> RequestRecord:
        async with slots:
            if send is None:
                rec = await send_request(client, req, config, gamma, start, deadline)
            else:
                rec = await loop.run_in_executor(threads, send, client, req, config, gamma, start, deadline)
        ends.append(time.perf_counter())
        if progress is not None:
            progress.update(1)
        return rec

    tasks = []
    start = time.perf_counter()
    deadline = start + config.duration_limit_s if config.duration_limit_s else None
    try:
        for req, offset in zip(requests, offsets):
            wake = start + float(offset)
            if deadline is not None:
                wake = min(wake, deadline)
            pause = wake - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.ensure_future(one(req)))
        records = list(await asyncio.gather(*tasks))
    finally:
        if threads is not None:
            threads.shutdown(wait=True)
        if progress is not None:
            progress.close()
    duration = (max(ends) if ends else time.perf_counter()) - start
    return records, duration


def _progress(total: int, config: WorkloadConfig):
    if not config.show_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="target-only" if config.target_only else "speculative", unit="req", leave=False)


# ---- metrics ------------------------------------------------------------------------


def percentile_key(q: float) -> str:
    """vLLM's key word for a percentile: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def result_percentiles(extra: Sequence[float] = ()) -> list[float]:
    """p90 and p99 (every result has them), and the --metric-percentiles asked for."""
    return sorted({90.0, 99.0, *map(float, extra)})


def _summary(name: str, values_s: Sequence[float], percentiles: Sequence[float] = ()) -> dict[str, float | None]:
    """mean / median / std and each percentile in ms (None without data)."""
    stats = ["mean", "median", "std", *map(percentile_key, result_percentiles(percentiles))]
    values_s = [v for v in values_s if v is not None]  # a request that could not time it: no NaN in the JSON
    if not values_s:
        return {f"{stat}_{name}_ms": None for stat in stats}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    out.update({f"{percentile_key(q)}_{name}_ms": float(np.percentile(ms, q)) for q in result_percentiles(percentiles)})
    return out


def _ratio(num: float, den: float, scale: float = 1.0) -> float | None:
    return num / den * scale if den else None


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}  # vLLM: one-token TPOT is 0
    return rec.ok and all(measured[k] is not None and measured[k] * 1000.0 <= v for k, v in slos_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    goodput_slos_ms: dict[str, float] | None = None, percentiles: Sequence[float] = ()) -> dict:
    ok = [r for r in records if r.ok]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    drafts = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    out: dict = {
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": _ratio(len(ok), duration) or 0.0,
        "output_throughput": _ratio(total_out, duration) or 0.0,
        # Tokens per second of a request's own life (sum over requests): the speedup basis,
        # meaningful per category and at any request rate, unlike the run's throughput.
        "output_tokens_per_request_s": _ratio(total_out, sum(r.e2el for r in ok)),
        "total_token_throughput": _ratio(total_in + total_out, duration) or 0.0,
    }
    out.update(_summary("ttft", [r.ttft for r in ok], percentiles))
    out.update(_summary("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles))
    out.update(_summary("itl", [gap for r in ok for gap in r.itl], percentiles))
    out.update(_summary("e2el", [r.e2el for r in ok], percentiles))
    out.update({
        "acceptance_rate": _ratio(accepted, drafts),
        "mean_accepted_tokens_per_round": _ratio(accepted, rounds) if drafts else None,
        "mean_tokens_per_round": _ratio(total_out, rounds),
        "mean_rounds_per_request": _ratio(rounds, len(ok)),
        "total_rounds": rounds,
        "total_draft_tokens": drafts,
        "total_accepted_tokens": accepted,
        # Client-measured call times, the inputs of the ideal-speedup model.
        "mean_draft_time_per_round_ms": _ratio(sum(r.draft_time for r in ok), rounds, 1000.0) if drafts else None,
        "mean_draft_time_per_token_ms": _ratio(sum(r.draft_time for r in ok), drafts, 1000.0),
        "mean_verify_time_per_round_ms": _ratio(sum(r.verify_time for r in ok), rounds, 1000.0),
        "mean_drafts_per_round": _ratio(drafts, rounds) if drafts else None,
        # The adaptive controller at work: the share of rounds that drafted at all (the rest
        # were target-only rounds: the first token, a drafter catching up, γ = 0 under load).
        "speculative_round_share": (None if any(r.speculative_rounds is None for r in ok)
                                    else _ratio(sum(r.speculative_rounds for r in ok), rounds)),
        # Rounds that wanted drafts and ran without them, no drafter answering (one down
        # mid-run): a share past 0 means the run is partly a target-only one.
        "drafter_fallback_round_share": _ratio(sum(r.drafter_fallback_rounds for r in ok), rounds),
        # Drafts the drafter had ready from its speculation cache (fanout > 0), of all drafts.
        "speculation_cache_hit_rate": _ratio(sum(r.cached_draft_tokens for r in ok), drafts),
        "goodput": None,
    })
    out.update(engine_metrics(ok, rounds, total_out, out["output_tokens_per_request_s"]))
    if goodput_slos_ms:
        good = sum(meets_slos(r, goodput_slos_ms) for r in ok)
        out["goodput"] = _ratio(good, duration) or 0.0
    out["request_goodput"] = out["goodput"]  # vLLM's name for it
    return out


def engine_metrics(ok: Sequence[RequestRecord], rounds: int, total_out: int,
                   measured_tokens_per_request_s: float | None) -> dict:
    """Per round: the verifier's device, step and host ms, the drafter's device ms; the
    engine-bound tokens/s (output tokens / device time of their rounds) and the measured
    tokens/s against it. None where the services reported no device time."""
    verify_device = sum(r.verify_device_time for r in ok)
    draft_device = sum(r.draft_device_time for r in ok)
    verify = sum(r.verify_time for r in ok)
    device = verify_device + draft_device
    engine_tps = _ratio(total_out, device) if verify_device > 0 else None
    return {
        "mean_verify_device_ms_per_round": _ratio(verify_device, rounds, 1000.0) if verify_device > 0 else None,
        "mean_verify_step_ms_per_round": _ratio(sum(r.verify_step_time for r in ok), rounds, 1000.0)
        if verify_device > 0 else None,
        "mean_verify_host_ms_per_round": _ratio(verify - verify_device, rounds, 1000.0) if verify_device > 0 else None,
        "mean_draft_device_ms_per_round": _ratio(draft_device, rounds, 1000.0) if draft_device > 0 else None,
        "engine_tokens_per_request_s": engine_tps,
        "engine_efficiency": _ratio(measured_tokens_per_request_s, engine_tps)
        if engine_tps and measured_tokens_per_request_s is not None else None,
    }


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E(γ) = (1 − α^(γ+1)) / (1 − α): tokens a round emits when each draft is accepted
    independently with probability α (γ + 1 when α = 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def efficiency(spec: dict, base: dict | None) -> dict[str, float | None]:
    """measured_speedup, ideal_speedup and system_efficiency of a speculative run against a
    target-only run of the same workload (all None without one): measured = ratio of
    output_tokens_per_request_s, ideal = ratio of engine_tokens_per_request_s (the engines'
    device times), system_efficiency = measured / ideal."""
    none = {"ideal_speedup": None, "measured_speedup": None, "system_efficiency": None}
    if base is None or not base.get("output_tokens_per_request_s"):
        return none
    measured = (spec.get("output_tokens_per_request_s") or 0.0) / base["output_tokens_per_request_s"]
    spec_engine, base_engine = spec.get("engine_tokens_per_request_s"), base.get("engine_tokens_per_request_s")
    if not spec_engine or not base_engine:
        return {**none, "measured_speedup": measured}
    ideal = spec_engine / base_engine
    return {"ideal_speedup": ideal, "measured_speedup": measured, "system_efficiency": measured / ideal}


def add_efficiency(result: dict, baseline: dict | None) -> dict:
    """Fill the speedup fields of a speculative result (and of its categories) in place."""
    result.update(efficiency(result, baseline))
    for cat, metrics in result.get("per_category", {}).items():
        base_cat = (baseline or {}).get("per_category", {}).get(cat)
        metrics.update(efficiency(metrics, base_cat))
    return result


# ---- the run ------------------------------------------------------------------------


def run_serve(config: WorkloadConfig, client: SpeculativeClient | None = None,
              baseline: dict | None = None) -> dict:
    """Run the workload once; returns the result dict (vLLM's keys plus ours)."""
    own_client = client is None
    if client is None:
        client = SpeculativeClient(config.verifier, drafter=None if config.target_only else config.drafter,
                                   num_speculative_tokens=config.num_speculative_tokens,
                                   timeout_s=_call_timeout(config), recovery_timeout_s=_call_timeout(config),
                                   decode_steps=config.decode_steps,
                                   batch_verify=True,  # one VerifyBatch per step, as the gateway sends them
                                   **config.client_security())
    try:
        if not config.target_only and client.drafter_info is None:
            # The client would run every round target-only (until a drafter answers): numbers
            # labelled speculative that are not.
            raise ValueError(f"no drafter of --drafter {config.drafter} answered: a speculative run would measure "
                             "target-only rounds; start the drafter, or pass --target-only for the baseline")
        gamma = _gamma(client, config)
        requests = build_requests(client, config)
        for req in requests[: config.warmup_requests]:
            client.generate(list(req.prompt_ids), config.params.replace(max_tokens=WARMUP_MAX_TOKENS),
                            num_speculative_tokens=gamma, target_only=config.target_only, fanout=config.fanout)
        roles = {"verifier": config.verifier}
        if not config.target_only:  # a target-only run never contacts the drafter
            roles["drafter"] = config.drafter
        security = dict(tls=config.tls, auth_token=config.auth_token)
        before = {role: pool_stats(addr, role, **security) for role, addr in roles.items()}
        records, duration = dispatch(client, requests, config, gamma)
        after = {role: pool_stats(addr, role, **security) for role, addr in roles.items()}
    finally:
        if own_client:
            client.close()
    stats = {role: {"before": before[role], "after": after[role], "delta": _stats_delta(before[role], after[role])}
             for role in roles}
    result = assemble_result(
        config, records, duration, backend="specdec", gamma=gamma, server_stats=stats,
        verifier_model=client.verifier_info.model,
        drafter_model=client.drafter_info.model if client.drafter_info and not config.target_only else None,
        shared_device=None if config.target_only else shares_device(client.drafter_info, client.verifier_info))
    if not config.target_only:
        add_efficiency(result, baseline)
    return result


def _gamma(client: SpeculativeClient, config: WorkloadConfig) -> int | str:
    if config.target_only:
        return 0
    if config.num_speculative_tokens == AUTO:
        return AUTO
    return client.effective_gamma(config.num_speculative_tokens)


def warm_up(client: SpeculativeClient, config: WorkloadConfig) -> dict:
    """One unmeasured wave before a measured point: as many requests as its concurrency
    (at least 2), all at once with the same max_tokens and mode, so the engines meet every
    batch size up to it (the batch shrinks as requests end) and the widths γ takes, and pay
    any first-time cost (CUDA-graph captures, allocator growth, kernel autotuning) here.
    Returns {"requests", "failed", "seconds"}."""
    n = max(2, config.max_concurrency or config.num_prompts)
    wave = config.replace(num_prompts=n, request_rate=math.inf, show_progress=False, seed=config.seed + 7919)
    return _unmeasured(client, build_requests(client, wave), wave, _gamma(client, wave))


def _unmeasured(client: SpeculativeClient, requests: Sequence[BenchRequest], config: WorkloadConfig,
                gamma: int | str) -> dict:
    """Send `requests` as `config` says, measuring nothing: {"requests", "failed", "seconds"}."""
    t0 = time.perf_counter()
    records, _ = dispatch(client, requests, config, gamma)
    return {"requests": len(requests), "failed": sum(not r.ok for r in records), "seconds": time.perf_counter() - t0}


def prime_prompts(client: SpeculativeClient, config: WorkloadConfig, seen: set | None = None) -> dict:
    """Prefill each prompt of the measured run once (target-only, one token each, at the run's
    concurrency) before the modes of a comparison run, so neither pays a prompt length's first
    cost for the other. Engines pay it per shape (oneDNN primitives here: 6-11 ms against 3-5 for
    a length seen before; kernel plans on a GPU), and the mode that ran first met most lengths
    first: on one H100 a speculative mode that drafted nothing ran at 0.57x of the target-only
    mode after it, and at 1.08x at the one point whose prompts an earlier point had run.
    seen: prompts (token-id tuples) primed already, skipped and added to. Returns {"requests",
    "failed", "seconds"}."""
    seen = set() if seen is None else seen
    requests = [r for r in build_requests(client, config) if r.prompt_ids not in seen]
    requests = list({r.prompt_ids: r for r in requests}.values())  # a dataset cycled: each prompt once
    if not requests:
        return {"requests": 0, "failed": 0, "seconds": 0.0}
    once = config.replace(target_only=True, request_rate=math.inf, show_progress=False,
                          params=config.params.replace(max_tokens=1, min_tokens=0))
    seen.update(r.prompt_ids for r in requests)
    return _unmeasured(client, requests, once, 0)


def workload_keys(config: WorkloadConfig) -> dict:
    """The result's fields that say which workload ran, as the arguments give them: a run
    compared with a --baseline-json must match its baseline on these (and on num_prompts)."""
    return {
        "dataset": config.dataset,
        **({"random_dataset": dataclasses.asdict(config.random_dataset)} if config.dataset == RANDOM else {}),
        "chat": config.chat and config.dataset != RANDOM,
        "request_rate": _json_rate(config.request_rate),
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "duration_limit_s": config.duration_limit_s,
        "seed": config.seed,
        "sampling": {k: v for k, v in dataclasses.asdict(config.params).items()
                     if k in ("temperature", "top_k", "top_p", "min_p", "max_tokens", "ignore_eos")},
    }


def assemble_result(config: WorkloadConfig, records: Sequence[RequestRecord], duration: float, *, backend: str,
                    gamma: int | str | None, server_stats: dict, verifier_model: str | None,
                    drafter_model: str | None, mode: str | None = None, base_url: str | None = None,
                    endpoint: str | None = None, shared_device: bool | None = None) -> dict:
    """The result dict of one run, whatever the backend measured it through: the same keys."""
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "mode": mode or ("target-only" if config.target_only else "speculative"),
        "verifier": config.verifier,
        "drafter": None if config.target_only else config.drafter,
        "base_url": base_url,  # --backend openai: the server measured, and its endpoint
        "endpoint": endpoint,
        "verifier_model": verifier_model,
        "drafter_model": drafter_model,
        # the client's verdict (shares_device): both engines on CPUs or on one GPU's UUID, so its
        # drafts take turns with the verifies (None: target-only, or not the specdec backend)
        "shared_device": shared_device,
        **workload_keys(config),
        "num_speculative_tokens": gamma,
        "fanout": 0 if config.target_only else config.fanout,
        "decode_steps": config.decode_steps,  # target-only steps a round without drafts may run
        "goodput_slos_ms": dict(config.goodput_slos_ms) or None,
    }
    result["metric_percentiles"] = result_percentiles(config.metric_percentiles)
    result["percentile_metrics"] = list(config.percentile_metrics)
    result.update(compute_metrics(records, duration, config.goodput_slos_ms, config.metric_percentiles))
    categories = sorted({r.category for r in records})
    result["per_category"] = {
        cat: compute_metrics([r for r in records if r.category == cat], duration, config.goodput_slos_ms,
                             config.metric_percentiles)
        for cat in categories
    }
    result["server_stats"] = server_stats
    result["per_request"] = [dataclasses.asdict(r) for r in records]
    # vLLM's per-request arrays (seconds; a failed request: 0 and its error), so scripts written
    # for `vllm bench serve --save-result` files read ours unchanged.
    result.update({
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft if r.ok else 0.0 for r in records],
        "itls": [list(r.itl) if r.ok else [] for r in records],
        "errors": [r.error or "" for r in records],
    })
    return result


def _call_timeout(config: WorkloadConfig) -> float:
    if config.duration_limit_s:
        return max(1.0, min(config.timeout_s, config.duration_limit_s))
    return config.timeout_s


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def load_result(path: str) -> dict:
    """A result file written by `bench serve --result-json`; ValueError naming the file otherwise."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a JSON result file ({exc})") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise ValueError(f"{path}: not a result of `specdec bench serve --result-json` (no 'completed' count)")
    return data


def write_json(data: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


# ---- printing -----------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_result(result: dict) -> str:
    """The result as vLLM's `bench serve` prints it, plus speculative figures and categories."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value, digits: int = 2) -> None:
        lines.append(f"{label:<40}{_fmt(value, digits):<10}")

    def section(title: str) -> None:
        lines.append(title.center(width, "-"))

    row("Mode:", result["mode"])
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate (req/s):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    if result.get("goodput") is not None:
        row("Request goodput (req/s):", result["goodput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency (per round)", "e2el": "End-to-end Latency"}
    for name in result.get("percentile_metrics") or LATENCY_METRICS:
        section(titles[name])
        upper = name.upper()
        row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", result[f"median_{name}_ms"])
        for q in result.get("metric_percentiles") or (90, 99):
            key = percentile_key(q)
            row(f"{key.upper()} {upper} (ms):", result.get(f"{key}_{name}_ms"))
    section("Speculative Decoding")
    row("Num speculative tokens (gamma):", result["num_speculative_tokens"])
    row("Draft acceptance rate:", result["acceptance_rate"], 3)
    row("Rounds that speculated:", result.get("speculative_round_share"), 3)
    if result.get("drafter_fallback_round_share"):
        row("Rounds without a drafter (down):", result["drafter_fallback_round_share"], 3)
    row("Mean gamma (all rounds):", result.get("mean_drafts_per_round"))
    row("Mean accepted tokens per round:", result["mean_accepted_tokens_per_round"])
    row("Mean tokens per round:", result["mean_tokens_per_round"])
    row("Mean rounds per request:", result["mean_rounds_per_request"])
    row("Draft time per drafted token (ms):", result["mean_draft_time_per_token_ms"])
    row("Verify time per round (ms):", result["mean_verify_time_per_round_ms"])
    section("Against the engines")
    row("Verify device ms per round:", result.get("mean_verify_device_ms_per_round"))
    row("Verify engine step ms per round:", result.get("mean_verify_step_ms_per_round"))
    row("Verify host ms per round:", result.get("mean_verify_host_ms_per_round"))
    row("Draft device ms per round:", result.get("mean_draft_device_ms_per_round"))
    row("Engine-bound tok/s per request:", result.get("engine_tokens_per_request_s"))
    row("Measured / engine-bound tok/s:", result.get("engine_efficiency"), 3)
    if result.get("fanout"):
        row("Speculation cache fanout:", result["fanout"])
        row("Drafts from the speculation cache:", result.get("speculation_cache_hit_rate"), 3)
    row("Ideal speedup:", result.get("ideal_speedup"))
    row("Measured speedup:", result.get("measured_speedup"))
    row("System efficiency (measured/ideal):", result.get("system_efficiency"), 3)
    lines.append("=" * width)
    if result.get("drafter_fallback_round_share"):
        lines.append(f"WARNING: {result['drafter_fallback_round_share']:.1%} of the rounds ran target-only because no "
                     "drafter answered: this is not a clean speculative run")
    lines.append(format_categories(result["per_category"]))
    return "\n".join(lines)


def format_categories(per_category: dict[str, dict]) -> str:
    header = (f"{'category':<16}{'done':>5}{'fail':>5}{'out tok/s':>10}{'med TTFT':>10}{'med TPOT':>10}"
              f"{'med E2EL':>10}{'accept':>8}")
    lines = [header, "-" * len(header)]
    for cat, m in per_category.items():
        lines.append(f"{cat:<16}{m['completed']:>5}{m['failed']:>5}{_fmt(m['output_throughput']):>10}"
                     f"{_fmt(m['median_ttft_ms'], 1):>10}{_fmt(m['median_tpot_ms'], 1):>10}"
                     f"{_fmt(m['median_e2el_ms'], 1):>10}{_fmt(m['acceptance_rate'], 3):>8}")
    return "\n".join(lines)


def accepted_per_round(results: Iterable[dict], gamma: int | str) -> list[int]:
    """Accepted drafts of every round that drafted the full γ (completed requests; the
    final rounds capped by max_tokens draft fewer and are left out when known); under
    γ "auto", of every round that drafted at all (its γ varies by round)."""
    counts = []
    for res in results:
        for r in res["per_request"]:
            if r["error"] is not None or not r["drafts_per_round"]:
                continue  # unknown drafts per round (fallback rounds, EOS): cannot tell full rounds
            drafts = r["drafts_per_round"]
            counts += [a for a, d in zip(r["accepted_per_round"], drafts)
                       if (d == gamma if isinstance(gamma, int) else d > 0)]
    return counts
