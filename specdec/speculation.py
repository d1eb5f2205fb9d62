"""Speculation cache of the drafter: the next round's drafts, prepared while the verifier
scores this round's.

After answering a Draft that asked for it (`fanout` F > 0), the drafter uses its idle
time to pre-draft the next round for the most likely verdict: every draft d_1..d_γ
accepted, followed by a bonus token b that is one of the drafter's own top-F candidates
after d_γ. Each candidate is a *branch*: a KV slot forked from the session's cache (the
first L = committed + γ − 1 positions), extended by [d_γ, b] and then by its own drafts,
one forward per draft, exactly as a plain Draft call would have run them. The session's
own cache is never written, so a miss costs nothing but idle time.

The next Draft of the session presents its sequence (truncated cache + appended ids).
If a branch's sequence equals it, its slot becomes the session's cache (a swap, no copy)
and its drafts are the answer: at once when the branch is complete, else after the
remaining draft steps (a partial hit). Every other branch of the session is dropped.
Since a branch runs the same rows with the same sampling parameters, seed and positions
as the plain call, the drafts, and so the verified output, are the same with or without
the cache; only when they arrive changes.

This module holds the bookkeeping (jobs, branches, slot reuse, bounds, counters) and no
model code; drafter_service/engine.py runs the forwards.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from specdec.errors import ResourceExhausted


@dataclass
class Branch:
    """One pre-drafted continuation. `slot` (None until forked) holds the KV of `tokens`;
    `pending` are the ids its next forward appends; drafts stop at `gamma`."""

    sequence_len: int  # len(prefix) + 2: the sequence the next Draft must present ends with [d_γ, b]
    candidate: int  # b
    tokens: list[int]
    pending: list[int]
    builder: Any  # the ProposalBuilder holding one wire row per draft
    drafts: list[int] = field(default_factory=list)
    slot: Any = None

    def done(self, gamma: int) -> bool:
        return len(self.drafts) >= gamma


@dataclass
class SpeculationJob:
    """What a Draft left to speculate on: the session's cache `source` holds `prefix`
    (committed + d_1..d_{γ−1}); `key` is everything else a matching request must share
    (sampling parameters, prompt length, proposal format, seed)."""

    session_id: str
    source: Any  # the session's KV slot at the time; its first len(prefix) positions stay valid until the next Draft
    prefix: list[int]
    last_draft: int  # d_γ
    gamma: int
    fanout: int
    key: Hashable
    candidates: list[int] | None = None  # None until the probe forward ran
    branches: list[Branch] = field(default_factory=list)

    @property
    def sequence_len(self) -> int:
        return len(self.prefix) + 2

    def current(self) -> Branch | None:
        """The first unfinished branch (branches run one after another, best candidate first)."""
        return next((b for b in self.branches if not b.done(self.gamma)), None)


@dataclass
class Work:
    """One row of an idle forward: the job's probe (branch None) or its current branch,
    with the slot it runs in and the ids it appends, as they were when it was chosen."""

    job: SpeculationJob
    branch: Branch | None
    slot: Any
    tokens: list[int]


@dataclass
class SpeculationStats:
    hits: int = 0  # answered wholly from a branch
    partial_hits: int = 0  # a branch supplied the first drafts, the rest were drafted on the critical path
    misses: int = 0  # a job was pending but no branch matched
    draft_tokens: int = 0  # drafted ahead, used or not
    dropped_branches: int = 0  # branches with drafts that were never used


class SpeculationCache:
    """Jobs by session (one each: a new Draft supersedes the old job), at most
    `max_branch_slots` branch slots in all, reused through a free list. Thread-safe: the
    engine thread runs jobs, gRPC threads drop those of closed sessions."""

    def __init__(self, max_branch_slots: int, new_slot: Callable[[], Any],
                 copy_prefix: Callable[[Any, Any, int], None]) -> None:
        if max_branch_slots < 0:
            raise ValueError(f"max_branch_slots must be >= 0, got {max_branch_slots}")
        self.max_branch_slots = max_branch_slots
        self._new_slot = new_slot
        self._copy_prefix = copy_prefix  # (dst, src, length): dst holds src's first `length` positions
        self._jobs: collections.OrderedDict[str, SpeculationJob] = collections.OrderedDict()  # oldest first
        self._free: list[Any] = []
        self._allocated = 0  # slots created by this cache and not handed to a session
        self._lock = threading.Lock()
        self.stats = SpeculationStats()

    # ---- jobs ---------------------------------------------------------------------

    def submit(self, job: SpeculationJob) -> None:
        with self._lock:
            old = self._jobs.pop(job.session_id, None)
            if old is not None:
                self._release_job(old)
            if self.max_branch_slots and job.fanout > 0:
                self._jobs[job.session_id] = job

    def drop(self, session_id: str) -> None:
        with self._lock:
            job = self._jobs.pop(session_id, None)
            if job is not None:
                self._release_job(job)

    def pending(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._jobs

    def candidates(self, session_id: str) -> list[int] | None:
        """The session's bonus candidates once every branch is complete, else None."""
        with self._lock:
            job = self._jobs.get(session_id)
            if job is None or job.candidates is None or job.current() is not None:
                return None
            return list(job.candidates)

    def take(self, session_id: str, sequence: list[int], key: Hashable) -> Branch | None:
        """The session's branch whose sequence is `sequence` and that has drafts, or None.
        Either way the session's job ends: other branches are released. The returned
        branch's slot now belongs to the caller (see `adopt`)."""
        with self._lock:
            job = self._jobs.pop(session_id, None)
            if job is None:
                return None
            found = None
            if (key == job.key and len(sequence) == job.sequence_len and sequence[-2] == job.last_draft
                    and sequence[: len(job.prefix)] == job.prefix):
                found = next((b for b in job.branches
                              if b.candidate == sequence[-1] and b.drafts and b.slot is not None), None)
            if found is not None:
                job.branches.remove(found)
                self._allocated -= 1  # the session owns it now
            self._release_job(job)
            if found is None:
                self.stats.misses += 1
            return found

    def adopt(self, old_session_slot: Any) -> None:
        """A hit swapped a branch slot into a session: its old slot joins the free list,
        so the number of slots (sessions + this cache) stays the same."""
        with self._lock:
            self._allocated += 1
            self._free.append(old_session_slot)
            self._trim()

    def work(self, limit: int, alive: Callable[[str], bool] = lambda sid: True) -> list[Work]:
        """The next forward: per job (oldest first, at most `limit`), its probe (branch
        None) or its current branch, forked into a slot when it starts. Jobs of sessions
        that are gone and jobs that cannot get a slot are dropped. Each item's slot and
        tokens are read under the lock: a gRPC thread may drop the job right after."""
        out: list[Work] = []
        with self._lock:
            for sid in list(self._jobs):
                if len(out) >= limit:
                    break
                job = self._jobs.get(sid)  # _acquire may have evicted it
                if job is None:
                    continue
                if not alive(sid):
                    self._release_job(self._jobs.pop(sid))
                    continue
                # a full cache evicts an older job, but never one already in this forward
                busy = {w.job.session_id for w in out} | {sid}
                if job.candidates is None:
                    if not job.branches:  # the probe runs in the first branch's slot
                        slot = self._acquire(exclude=busy)
                        if slot is None:
                            continue
                        self._copy_prefix(slot, job.source, len(job.prefix))
                        job.branches.append(Branch(job.sequence_len, -1, list(job.prefix), [job.last_draft], None,
                                                   slot=slot))
                    out.append(Work(job, None, job.branches[0].slot, [job.last_draft]))
                    continue
                branch = job.current()
                if branch is None:
                    continue
                if branch.slot is None:
                    branch.slot = self._acquire(exclude=busy)
                    if branch.slot is None:
                        continue
                    self._copy_prefix(branch.slot, job.source, len(job.prefix))
                out.append(Work(job, branch, branch.slot, list(branch.pending)))
        return out

    def start(self, job: SpeculationJob, candidates: list[int], new_builder: Callable[[], Any]) -> None:
        """After the probe: one branch per candidate, the first in the probe's slot (which
        the caller cut back to the prefix, so that [d_γ, b] runs as one row as in the plain call)."""
        with self._lock:
            if self._jobs.get(job.session_id) is not job or not job.branches:
                return  # dropped meanwhile
            probe = job.branches[0]
            job.candidates = candidates
            job.branches = [Branch(job.sequence_len, b, list(job.prefix), [job.last_draft, b], new_builder(),
                                   slot=probe.slot if i == 0 else None) for i, b in enumerate(candidates)]
            if not job.branches:
                self._free.append(probe.slot)

    # ---- slots --------------------------------------------------------------------

    def _acquire(self, exclude: set[str]) -> Any | None:
        if self._free:
            return self._free.pop()
        if self._allocated < self.max_branch_slots:
            try:
                slot = self._new_slot()
            except ResourceExhausted:  # the KV pool is full: sessions come first, the job waits
                return None
            self._allocated += 1  # only once it exists: a failed allocation counted, and leaked, a slot
            return slot
        # Full: take the slots of the oldest other job that holds any (its session will miss).
        for sid, job in self._jobs.items():
            if sid not in exclude and any(b.slot is not None for b in job.branches):
                self._release_job(self._jobs.pop(sid))
                return self._free.pop() if self._free else None
        return None

    def _release_job(self, job: SpeculationJob) -> None:
        for b in job.branches:
            if b.slot is not None:
                self._free.append(b.slot)
                b.slot = None
            if b.drafts:
                self.stats.dropped_branches += 1
        job.branches.clear()
        self._trim()

    def _trim(self) -> None:
        while self._allocated > self.max_branch_slots and self._free:
            self._free.pop()
            self._allocated -= 1

    def slots_in_use(self) -> int:
        with self._lock:
            return self._allocated

    def slot_bytes(self, nbytes: Callable[[Any], int]) -> int:
        """Memory held by branch slots (in use or free)."""
        with self._lock:
            held = list(self._free) + [b.slot for j in self._jobs.values() for b in j.branches if b.slot is not None]
            return sum(nbytes(s) for s in held)
