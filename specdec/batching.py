"""Continuous batching: gRPC threads submit work items; one engine thread runs them in batches.

Policy (`--max-batch-size`, `--max-wait-ms`): when the engine thread is free it takes the
oldest waiting item, then every item already queued up to the batch size, then — only if
the previous batch held more than one request, so a lone session never waits — waits up
to `max_wait_ms` for more while the batch is not full. Measured on the 2-core CPU with 32
sessions (`specdec bench verifier`): mean batch 16.9 without waiting, 27.0 with 10 ms, and
1.2x the throughput; sessions that arrive in step with each other otherwise split into
alternating half batches. The wait ends as soon as the batch holds every running session
(`expected`): with 8 sessions and a batch size of 64, waiting for a 9th that does not exist
cost every step the whole 10 ms (`bench verifier`, tiny model, concurrency 8: p50 round
19.8 ms against a 5.9 ms step).

Items that came as one client's step (a VerifyBatch call or VerifyStream message: `gathered`)
wait at most a tenth of the last step: that client already gathered what it had, and the rest
of its sessions come in its next message, after its own turnaround of the rows just answered.
Holding the engine the full 10 ms for them serialised that turnaround with a short step
(`bench serve` target-only through the client, tiny model, 18 ms steps of 64 rows, round
35 ms); not waiting at all split the rounds of the embedded pair, whose 40-55 ms steps dwarf
the client's turnaround, into alternating partial batches (concurrency 8: 111 against 136
tok/s). A tenth of the step: tiny 1.1x / 1.2x the tokens/s of the 10 ms wait at concurrency
32 / 64, the embedded pair as before. Unary calls, which arrive one by one, keep the full
wait (without it, 658 against 952 rounds/s at concurrency 8).

Carried work: `run_batch` may return items it has not finished: a long prompt that took one
chunk of the step's token budget (chunked prefill: it advances one bounded step at a time
between the decode steps of everyone else), or a round of several decode steps whose row stays
in the batch. They open the next batch, ahead of the queue, and new items join them only up to
the batch size.

All torch work of a service runs on this one thread: torch's OpenMP team belongs to the
calling OS thread, and forwards issued from many gRPC threads ran ~1.5-2x slower on CPU.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specdec.argtypes import MAX_WAIT_MS
from specdec.errors import EngineStopped

log = logging.getLogger(__name__)


GATHERED_WAIT_SHARE = 0.1  # a step message's rows wait for the rest at most this share of a step (module doc)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 32
    max_wait_ms: float = 10.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.max_wait_ms <= MAX_WAIT_MS:  # NaN fails this too
            raise ValueError(f"--max-wait-ms must be in [0, {MAX_WAIT_MS:.0f}], got {self.max_wait_ms}")


@dataclass(eq=False)  # identity: `in` over a batch of carried items compared payloads field by field
class WorkItem:
    """One request inside a batch: `payload` in, `future` out (result or exception)."""

    payload: Any
    future: Future = field(default_factory=Future)
    gathered: bool = False  # part of a client's step message: a shorter batching wait (module doc)
    # Whether its caller still waits for the result (gRPC: the call is active); None: always.
    # The engine drops an item whose caller is gone before its next step (serving.drop_closed).
    alive: Callable[[], bool] | None = None


@dataclass
class BatchStats:
    sizes: dict[int, int] = field(default_factory=dict)  # batch size -> how many batches had it

    @property
    def batches(self) -> int:
        return sum(self.sizes.values())

    @property
    def rows(self) -> int:
        """Rows of all batches: rows / batches is the mean batch size."""
        return sum(size * n for size, n in list(self.sizes.items()))  # a copy: the engine thread may count meanwhile


class BatchScheduler:
    """Runs `run_batch(items)` on a dedicated thread; `run_batch` settles every item's future,
    or returns the unfinished ones, which it gets back first in the next batch."""

    def __init__(self, run_batch: Callable[[list[WorkItem]], list[WorkItem] | None], policy: BatchPolicy = BatchPolicy(),
                 threads: int | None = None, name: str = "engine", idle: Callable[[], bool] | None = None,
                 expected: Callable[[], int] | None = None) -> None:
        """idle: background work (the drafter's speculation), one short step per call, run
        only while no request waits; returns False when there is none left. expected: how
        many requests a batch can hope for (the running sessions); waiting stops there."""
        self.policy = policy
        self.stats = BatchStats()
        self._run_batch = run_batch
        self._idle = idle
        self._expected = expected
        self._threads = threads
        self._queue: queue.Queue[WorkItem | None] = queue.Queue()
        self._last_batch_size = 0
        self._last_step_s = 0.0  # how long the last batch ran
        # Set when the engine thread ended on an error: every request then fails at once
        # (EngineStopped), and the server watching it stops serving (adapters.serve).
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self._in_hand: list[WorkItem] = []  # the batch being collected or run
        self._failing = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-engine", daemon=True)
        self._thread.start()

    def submit(self, payload: Any, alive: Callable[[], bool] | None = None) -> Any:
        """Queue one item and block until its batch ran; exceptions propagate to the caller."""
        return self.submit_many([payload], alive=alive)[0].result()

    def submit_many(self, payloads: list[Any], gathered: bool = False,
                    alive: Callable[[], bool] | None = None) -> list[Future]:
        """Queue several items at once (one client step of many sessions); they can share a
        batch. The caller waits on the returned futures. gathered: a client's step message;
        alive: whether its caller still waits (WorkItem.alive)."""
        items = [WorkItem(p, gathered=gathered, alive=alive) for p in payloads]
        for item in items:
            self._queue.put(item)
        if self.error is not None:  # after the put: the dying thread's sweep may have run already
            self._fail_all()
        return [item.future for item in items]

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def waiting(self) -> int:
        """Requests queued for the next batch (approximate: the queue is read without a lock)."""
        return self._queue.qsize()

    def _collect(self, first: WorkItem, carried: list[WorkItem] = ()) -> list[WorkItem]:
        """`carried` (unfinished items of the last batch) first; then, with carried work, only
        what is queued already, up to the batch size: carried work never waits for company."""
        batch = [*carried, first] if first is not None else list(carried)
        self._in_hand = batch  # appended to below: what an engine failure must fail besides the queue
        wait_ms = self.policy.max_wait_ms if self._last_batch_size > 1 and not carried else 0.0
        if first is not None and first.gathered:  # a client's step: its other rows come after its turnaround
            wait_ms = min(wait_ms, GATHERED_WAIT_SHARE * 1000 * self._last_step_s)
        deadline = time.monotonic() + wait_ms / 1000
        full = self.policy.max_batch_size
        if wait_ms and self._expected is not None:
            full = min(full, max(self._expected(), 1))
        while len(batch) < self.policy.max_batch_size:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or len(batch) >= full:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if item is None:
                self._queue.put(item)  # shut down after this batch
                break
            batch.append(item)
        return batch

    def _next_item(self) -> WorkItem | None:
        """The next request; while none waits, idle steps run one at a time, so a request
        waits for at most one of them."""
        while self._idle is not None:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            try:
                if not self._idle():
                    break
            except Exception:  # noqa: BLE001 - background work must not stop the engine
                log.exception("idle step failed")
                break
        return self._queue.get()

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - outside a batch: the engine cannot go on
            log.critical("the engine thread stopped: %r", exc, exc_info=True)
            self.error = exc
            self._fail_all()
            self.stopped.set()

    def _fail_all(self) -> None:
        """Fail the requests the engine held and every queued one with EngineStopped (from the
        dying engine thread, and from a submitting thread after it: one at a time)."""
        with self._failing:
            held = list(self._in_hand)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    held.append(item)
            for item in held:
                if not item.future.done():
                    item.future.set_exception(EngineStopped(f"the engine stopped on an error ({self.error!r}); "
                                                            "this replica serves nothing more"))

    def _serve(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        carried: list[WorkItem] = []
        while True:
            if len(carried) >= self.policy.max_batch_size:
                first = None  # a full batch of carried rows takes nothing new until some finish
            elif carried:
                try:
                    first = self._queue.get_nowait()
                except queue.Empty:
                    first = None
                else:
                    if first is None:
                        self._queue.put(None)  # the shutdown marker: finish the carried work first
            else:
                first = self._next_item()
                if first is None:
                    return
            batch = self._collect(first, carried) if first is not None else carried
            self._last_batch_size = len(batch)
            self.stats.sizes[len(batch)] = self.stats.sizes.get(len(batch), 0) + 1
            try:
                started = time.monotonic()
                carried = [it for it in (self._run_batch(batch) or []) if not it.future.done()]
                self._last_step_s = time.monotonic() - started
            except BaseException as exc:  # noqa: BLE001 - the whole batch failed: tell every caller
                log.exception("batch of %d failed", len(batch))
                carried = []
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
            for item in batch:  # a run_batch bug must not leave a caller waiting forever
                if not item.future.done() and item not in carried:
                    item.future.set_exception(RuntimeError("the engine did not settle this request"))
            # Drop this batch's references before blocking for the next one: a request holds
            # its session, hence its KV slot, and a slot pool gets it back only when the
            # last reference goes.
            self._in_hand = carried
            del first, batch, item

