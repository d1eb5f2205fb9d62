"""What the drafter and verifier engines share: the model, its sessions, request checks.

The engines themselves live in drafter_service/engine.py and verifier_service/engine.py;
neither imports grpc.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.argtypes import LOGPROBS_MODES
from specdec.batching import BatchPolicy, BatchScheduler, WorkItem
from specdec.errors import CallCancelled, InvalidArgument, OutOfRange, ResourceExhausted, SessionClosed
from specdec.models import CausalLM, ModelSpec, device_uuid, tokenizer_source
from specdec.sampling import SamplingParams, TokenContext, check_min_tokens
from specdec.sessions import SessionStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    role: str
    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    tokenizer_fingerprint: str
    tokenizer_source: str
    dtype: str
    device: str
    max_draft_tokens: int
    max_sessions: int = 0  # sessions admitted at once; 0: not said (a server before this field)
    instance_id: str = ""  # random per server process; "": not said
    device_uuid: str = ""  # the accelerator's UUID (CUDA); "": a CPU, or not said


@dataclass(frozen=True)
class EngineLoad:
    """The load a service carried when it answered one call (protocol: EngineLoad). The
    client's adaptive γ fits step cost against step size from these, and reads how many
    sessions share the engine, to see whether speculation still pays (specdec/adaptive.py)."""

    running_sessions: int = 0  # live sessions that called within RUNNING_WINDOW_S
    step_rows: int = 0  # requests in the step that served the call (drafter: mean over its steps)
    step_tokens: int = 0  # tokens that step ran through the model (drafter: mean over its steps)
    step_ms: float = 0.0  # engine time of that step (drafter: mean per step)
    queue_ms: float = 0.0  # wait before the call's first step
    speculation_disabled: bool = False  # the verifier's --speculative-disable-by-batch-size is reached
    device_ms: float = 0.0  # of step_ms: the forward and the sampler on the device (drafter: mean per step)
    host_ms: float = 0.0  # of step_ms: the engine thread's own work around them (drafter: mean per step)


class DeviceTimer:
    """Device time of one stretch of a step. On CUDA two events bracket the queued work and are
    read after the step's own host sync (no extra synchronisation); on a CPU the work runs
    in the calls themselves, so their wall time is the device time."""

    def __init__(self, device) -> None:
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._t0 = self._t1 = 0.0
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:  # on the model's stream: the engine thread's current device may be another
            self._start.record(torch.cuda.current_stream(self._device))
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._end.record(torch.cuda.current_stream(self._device))
        self._t1 = time.perf_counter()

    def ms(self) -> float:
        """Call after the results were read back (the host has waited for the device)."""
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        return (self._t1 - self._t0) * 1e3


# Bucket upper bounds (ms) of the step phase histograms: from a CUDA-graph step to a CPU prefill.
PHASE_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)
PHASES = ("queue", "prepare", "device", "reply", "step")


class StepPhases:
    """Where engine time goes, per phase: `queue` (a request's wait before its first step),
    `prepare` (host work before the device work is queued), `device` (forward + sampler),
    `reply` (host work after it: bookkeeping, settling the callers) and `step` (the whole
    step). Written by the engine thread only; read by the metrics scrape (a torn read of a
    bucket is one observation off, never a crash)."""

    bounds_ms = PHASE_BUCKETS_MS  # the histograms' upper bounds; `counts` has one more (+Inf)

    def __init__(self) -> None:
        self.counts = {p: [0] * (len(PHASE_BUCKETS_MS) + 1) for p in PHASES}  # last: +Inf
        self.sums_ms = dict.fromkeys(PHASES, 0.0)

    def observe(self, phase: str, ms: float) -> None:
        self.counts[phase][bisect.bisect_left(PHASE_BUCKETS_MS, ms)] += 1  # the first bucket with ms <= bound
        self.sums_ms[phase] += ms

    def step(self, prepare_ms: float, device_ms: float, reply_ms: float, step_ms: float) -> None:
        for phase, ms in (("prepare", prepare_ms), ("device", device_ms), ("reply", reply_ms), ("step", step_ms)):
            self.observe(phase, ms)

    def mean_ms(self, phase: str) -> float:
        n = sum(self.counts[phase])
        return self.sums_ms[phase] / n if n else 0.0


# A new session waits this long for a KV slot of the fast path's pool that a closed session's
# call still holds (SlotPool.acquire): such a call ends within a step.
SESSION_SLOT_WAIT_S = 2.0

RUNNING_WINDOW_S = 2.0  # a session that called within this many seconds counts as running


class RunningSessions:
    """Which sessions are in a generation right now: those that called within the window and
    are still open. A call counts from its arrival (gRPC threads), not from the step that
    serves it: sessions arriving together all count in the first reply, though their prompts
    take several chunked steps."""

    def __init__(self, window_s: float = RUNNING_WINDOW_S) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def touch(self, session_ids, now: float) -> None:
        with self._lock:
            for sid in session_ids:
                self._last[sid] = now

    def count(self, now: float, alive) -> int:
        """alive(session_id) -> bool: closed sessions stop counting at once."""
        cutoff = now - self.window_s
        with self._lock:
            for sid in [sid for sid, t in self._last.items() if t < cutoff or not alive(sid)]:
                del self._last[sid]
            return len(self._last)


@dataclass
class ServingStats:
    """Counters since start; `snapshot` adds the live gauges. Updated under a lock
    because gRPC worker threads and the engine thread both record."""

    requests: int = 0
    failed_requests: int = 0
    cancelled_requests: int = 0  # dropped: their session closed while they were in flight (drop_closed)
    forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


@dataclass(frozen=True)
class EngineConfig:
    max_draft_tokens: int = 16
    max_sessions: int = 256
    session_ttl_s: float = 600.0
    evict_after_idle_s: float = 2.0  # a full server evicts only sessions idle this long (specdec.sessions)
    kv_budget_mb: float | None = None  # None: no byte budget, only max_sessions
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    speculation_slots: int = 16  # drafter: KV slots for pre-drafted branches (DraftRequest.fanout), all sessions
    sampler_backend: str = "auto"  # verifier: "auto" | "torch" | "triton" (specdec.verification.resolve_backend)
    # Verifier: generated tokens' logprobs under the processed distribution they were sampled
    # from ("processed_logprobs") or the model's raw one ("raw_logprobs", vLLM V1's default).
    logprobs_mode: str = "processed_logprobs"
    # Tokens one engine step runs through the model (vLLM's --max-num-batched-tokens): longer
    # appends are prefilled in chunks between other sessions' steps. None: DEFAULT_BATCHED_TOKENS.
    max_num_batched_tokens: int | None = None
    # Verifier: at this many running sessions, tell clients to stop drafting (vLLM's name); 0 = never.
    speculative_disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")


# Chunk budget per step when none is given: on a CPU a 256-token float32 step of a small model
# costs a few decode steps (bounded stalls); on a GPU, 2048 keeps prefill efficient.
DEFAULT_BATCHED_TOKENS = {"cpu": 256, "cuda": 2048}


def _failure_counter(exc: BaseException) -> str:
    """A call its client gave up on is no engine failure (alerts watch failed_requests)."""
    return "cancelled_requests" if isinstance(exc, (SessionClosed, CallCancelled)) else "failed_requests"


def drop_closed(items: list[WorkItem]) -> list[WorkItem]:
    """The items whose session is still open and whose caller still waits; the others fail
    without running (NOT_FOUND, CANCELLED), and a failed call crops its session back to where
    it started (SessionStore.use). A client that gives up on a generation (a cancelled HTTP
    request) closes its sessions, and a long prompt's chunked prefill would otherwise run to
    its end, step after step, ahead of everyone else's rounds (8 abandoned 1,800-token prompts
    kept a CPU verifier busy for 50 s). A call whose deadline passed, or that its client
    cancelled, went on the same way and held its session meanwhile: a retry on it was refused
    FAILED_PRECONDITION until the dead call's prefill ended."""
    live = []
    for item in items:
        session = item.payload.session
        if session.closed:
            item.future.set_exception(SessionClosed(f"session {session.session_id} was closed while its call was in "
                                                    "flight"))
        elif item.alive is not None and not item.alive():
            item.future.set_exception(CallCancelled(f"session {session.session_id}: the call was cancelled or its "
                                                    "deadline passed before it finished"))
        else:
            live.append(item)
    return live


class ServingModel:
    """A model, its session store, and the batch scheduler whose thread runs all torch work.

    gRPC handlers validate a request, hold its session (exclusively, truncated to
    `truncate_to`) and submit it; the engine thread gathers concurrent requests of
    different sessions into one batched forward and one batched sampler call
    (`_run_batch`, per engine), then settles each request.
    """

    role = "model"
    # A verifier refuses logit_bias / allowed_token_ids ids past its vocabulary; a drafter skips
    # them (apply_token_filters): its head may be smaller than the target's, and the verifier decides.
    strict_token_filters = True

    def __init__(self, spec: ModelSpec, config: EngineConfig = EngineConfig(), lm: CausalLM | None = None) -> None:
        self.spec = spec
        self.config = config
        device_type = "cuda" if str(spec.device).startswith("cuda") else "cpu"
        self.max_batched_tokens = config.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS[device_type]
        # One step must hold any single verify: the longest draft, its catch-up token and its bonus.
        if self.max_batched_tokens < config.max_draft_tokens + 2:
            raise ValueError(f"--max-num-batched-tokens must be >= --max-draft-tokens + 2 = {config.max_draft_tokens + 2}"
                             f", got {self.max_batched_tokens}")
        self.lm = lm or CausalLM(spec)
        # What the model turned out to be (an --quantize that found nothing to quantize is dropped)
        spec = self.spec = getattr(self.lm, "spec", spec)
        budget = None if config.kv_budget_mb is None else int(config.kv_budget_mb * 2**20)
        max_sessions = self._configure_pool(config, budget)
        self.sessions = SessionStore(
            lambda: self.lm.new_cache(SESSION_SLOT_WAIT_S), self.lm.crop, max_sessions=max_sessions,
            ttl_s=config.session_ttl_s,
            evict_after_idle_s=config.evict_after_idle_s,
            kv_budget_bytes=budget, cache_bytes=self.lm.cache_bytes, on_remove=self._session_removed,
        )
        self.running = RunningSessions()
        self.scheduler = BatchScheduler(
            self._run_batch, BatchPolicy(config.max_batch_size, config.max_wait_ms), threads=self.lm.threads,
            name=self.role, idle=self._idle,
            expected=lambda: self.running.count(time.monotonic(), self.sessions.__contains__),
        )
        self.stats = ServingStats()
        self.phases = StepPhases()
        self.info = ModelInfo(
            role=self.role,
            model=spec.display_name,
            vocab_size=self.lm.vocab_size,
            eos_token_ids=tuple(self.lm.eos_token_ids),
            max_context=self.lm.max_context,
            tokenizer_fingerprint=self.lm.tokenizer_fingerprint,
            tokenizer_source=tokenizer_source(spec),
            dtype=spec.dtype + (f"+{spec.quantize}" if spec.quantize else ""),
            device=spec.device,
            device_uuid=device_uuid(getattr(self.lm, "device", None)),
            max_draft_tokens=config.max_draft_tokens,
            max_sessions=max_sessions,
            instance_id=secrets.token_hex(8),
        )

    def _configure_pool(self, config: EngineConfig, budget: int | None) -> int:
        """The model's KV slot pool (fast path), and the session cap it leaves: every session
        and speculation branch holds a slot, and +1 because a session takes its slot before the
        least recently used one is evicted to make room (the store admits one at a time).
        Steps are as wide as a verify of the longest draft plus a catch-up token."""
        reserved = config.speculation_slots + 1
        slots = self.lm.configure_pool(config.max_sessions + reserved, max_batch=config.max_batch_size,
                                       max_width=config.max_draft_tokens + 2, budget_bytes=budget)
        if slots is None and budget is not None and getattr(self.lm, "slots", None) is not None:
            # A slot is preallocated at open: a budget below one slot would refuse every session
            # at its first call (and clients retry a refusal until their timeout), so say it now.
            one = self.lm.slots.new_slot_bytes()
            if one > budget:
                raise ResourceExhausted(f"--kv-budget-mb {config.kv_budget_mb:g} holds no session: one session's KV "
                                        f"({self.lm.max_context} tokens) takes {one / 2**20:.1f} MiB; raise "
                                        "--kv-budget-mb or lower --max-model-len")
            # What GetModelInfo reports and refusals cite: the budget's count, not --max-sessions'
            return min(config.max_sessions, budget // one)
        if slots is None or slots >= config.max_sessions + reserved:
            return config.max_sessions
        if slots <= reserved:
            raise ResourceExhausted(f"the KV slot pool holds {slots} slots, not more than the {reserved} reserved for "
                                    "speculation branches and admission; raise --kv-budget-mb or lower --max-model-len")
        log.warning("the KV slot pool holds %d slots: at most %d sessions instead of --max-sessions %d",
                    slots, slots - reserved, config.max_sessions)
        return slots - reserved

    def snapshot_stats(self) -> dict[str, int]:
        """Counters plus live sessions and the KV they hold."""
        out = self.stats.as_dict()
        out["live_sessions"] = len(self.sessions)
        out["kv_tokens"] = self.sessions.kv_tokens()
        out["kv_bytes"] = self.sessions.kv_bytes()
        out["batches"] = self.scheduler.stats.batches
        out["batched_rows"] = self.scheduler.stats.rows
        out["evictions"] = self.sessions.evictions
        return out

    def open_session(self, owner: str | None = None) -> str:
        """`owner` (a hash of the caller's credential, or None) alone may use the session."""
        return self.sessions.open(owner).session_id

    def close_session(self, session_id: str, owner: str | None = None) -> None:
        self.sessions.close(session_id, owner)

    def _session_removed(self, session_id: str) -> None:
        """A session left the store (closed, evicted or expired): whatever else holds its cache
        lets go of it here (the drafter's speculation job)."""

    def check_request(
        self, truncate_to: int, append_token_ids: list[int], num_draft: int, params: SamplingParams,
        draft_field: str = "num_draft_tokens", prompt_length: int = 0, fanout: int = 0,
    ) -> None:
        """Checks that need no session: ids, gamma, lengths (and a drafter's fanout). `params`
        was validated when it was built (SamplingParams is frozen)."""
        if fanout < 0:
            raise InvalidArgument("fanout", f"must be >= 0, got {fanout}")
        if truncate_to < 0:  # first: the prompt_length bound below is stated in terms of it
            raise InvalidArgument("truncate_to", f"must be >= 0, got {truncate_to}")
        self.check_token_ids(list(params.stop_token_ids), "sampling.stop_token_ids")
        if params.has_token_filters:
            self._check_token_filters(params)
        check_min_tokens(params, self.lm.vocab_size, self.info.eos_token_ids, field_prefix="sampling.")
        if not 0 <= prompt_length <= truncate_to + len(append_token_ids):
            raise InvalidArgument(
                "prompt_length",
                f"must be in [0, truncate_to + len(append_token_ids) = {truncate_to + len(append_token_ids)}], "
                f"got {prompt_length}",
            )
        if not append_token_ids:
            raise InvalidArgument(
                "append_token_ids",
                "must hold at least the last committed token (its logits start the next position)",
            )
        self.check_token_ids(append_token_ids, "append_token_ids")
        self.check_sizes(truncate_to, len(append_token_ids), num_draft, draft_field)

    def check_sizes(self, truncate_to: int, num_append: int, num_draft: int,
                    draft_field: str = "num_draft_tokens") -> None:
        """check_request's bounds on the lengths alone, before a message's ids are copied and
        checked one by one: an append of 60 million ids (a message under the 64 MB cap) took
        seconds and 2 GB of a verifier, and stalled its other calls, before it was refused."""
        if not 0 <= num_draft <= self.config.max_draft_tokens:
            raise InvalidArgument(draft_field, f"must be in [0, {self.config.max_draft_tokens}], got {num_draft}")
        end = truncate_to + num_append + num_draft
        if truncate_to >= 0 and end > self.lm.max_context:
            raise OutOfRange(
                f"truncate_to + len(append_token_ids) + drafts = {end} exceeds the maximum context {self.lm.max_context}"
            )

    def _check_token_filters(self, params: SamplingParams) -> None:
        if self.strict_token_filters:
            self.check_token_ids([t for t, _ in params.logit_bias], "sampling.logit_bias")
            self.check_token_ids(list(params.allowed_token_ids or ()), "sampling.allowed_token_ids")

    def token_context(self, tokens: list[int], prompt_length: int) -> TokenContext:
        return TokenContext(prefix=tokens, prompt_length=prompt_length, eos_token_ids=self.info.eos_token_ids)

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        vocab = self.lm.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(field, f"token id {bad[0]} is outside [0, {vocab})")

    def submit(self, payload, alive: Callable[[], bool] | None = None) -> object:
        """Queue one request for the next batch and wait for its result (exceptions propagate).
        alive: whether the caller still waits (a gRPC call's `is_active`); None: always."""
        session = getattr(payload, "session", None)
        if session is not None:
            self.running.touch([session.session_id], time.monotonic())
        try:
            result = self.scheduler.submit(payload, alive)
        except BaseException as exc:
            self.stats.add(**{_failure_counter(exc): 1})
            raise
        self.stats.add(requests=1)
        return result

    def queue_many(self, payloads: list, alive: Callable[[], bool] | None = None) -> list[Future]:
        """`submit` for several requests at once (one client step of many sessions), every one
        queued before any is waited for, so they share a step; `collect` waits."""
        self.running.touch([p.session.session_id for p in payloads if getattr(p, "session", None)], time.monotonic())
        return self.scheduler.submit_many(payloads, gathered=True, alive=alive)

    def collect(self, futures: list[Future]) -> list[object]:
        """Per future of `queue_many`, its result or the exception it raised (counted)."""
        out: list[object] = []
        for future in futures:
            try:
                out.append(future.result())
                self.stats.add(requests=1)
            except Exception as exc:  # noqa: BLE001 - this request alone failed
                self.stats.add(**{_failure_counter(exc): 1})
                out.append(exc)
        return out

    def note_running(self, session_ids, now: float | None = None) -> int:
        """Engine thread: mark `session_ids` as running; returns how many sessions run now."""
        now = time.monotonic() if now is None else now
        self.running.touch(session_ids, now)
        return self.running.count(now, self.sessions.__contains__)

    def _run_batch(self, items: list[WorkItem]) -> list[WorkItem] | None:
        raise NotImplementedError

    def _idle(self) -> bool:
        """One step of background work on the engine thread, if any (see BatchScheduler)."""
        return False

    def shutdown(self) -> None:
        self.scheduler.shutdown()
