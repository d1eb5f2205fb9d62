"""Per-session KV caches: open / close, truncation, idle TTL, LRU eviction under a
session cap and a KV memory budget.

State lives here, not in the gRPC layer. A session is used by one call at a time: a
second concurrent call on it is refused (SessionBusy) rather than interleaved, and a
call that fails midway restores the cache to the length it truncated to, so the
client's bookkeeping stays valid. Admission first drops expired sessions, then evicts
the least recently used idle sessions until the new one fits both limits. Idle means no
call for `evict_after_idle_s` (2 s): a generation between two of its rounds is idle for
milliseconds, and evicting it only to admit another made clients that share a server
(separate gateways, processes) evict each other's running generations, each re-prefilled
in turn (6 clients, 2 sessions: 348 evictions and 4x the time of queueing). When no
session qualifies the new one is refused (ResourceExhausted, "retry later"), and the
client queues. An evicted or expired id answers NOT_FOUND saying so, and the client
re-prefills.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from specdec.errors import (
    InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy, SessionNotFound, display_id,
)
from specdec.sampling import SamplingParams, random_seed

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    cache: Any  # the model's KV cache object
    seed: int  # server randomness for requests without a seed
    length: int = 0  # tokens held in the KV cache
    tokens: list[int] = field(default_factory=list)  # the ids behind those KV entries (penalties need them)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Who may use the session (a hash of the caller's credential), None = anyone. A
    # leaked id alone is then useless: another caller gets NOT_FOUND, as if it did not exist.
    owner: str | None = None
    # Closed while a call held it (a client gave up on the generation): the engine drops that
    # call's remaining work (the rest of a chunked prefill, its queued step) instead of running it.
    closed: bool = False

    def seed_for(self, params: SamplingParams) -> int:
        """The request's seed, else this session's own server randomness."""
        return params.seed if params.seed is not None else self.seed


class SessionStore:
    """Sessions by unguessable id, with an idle TTL and a cap on live sessions."""

    def __init__(
        self,
        new_cache: Callable[[], Any],
        crop: Callable[[Any, int], None],
        *,
        max_sessions: int = 256,
        ttl_s: float = 600.0,
        kv_budget_bytes: int | None = None,
        cache_bytes: Callable[[Any], int] = lambda cache: 0,
        evict_after_idle_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_remove: Callable[[str], None] = lambda session_id: None,
    ) -> None:
        """on_remove(session_id): after a session is closed, evicted or expired (outside the
        store's lock), for what else holds on to it (the drafter's speculation job)."""
        self._new_cache = new_cache
        self._crop = crop
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.kv_budget_bytes = kv_budget_bytes
        self._cache_bytes = cache_bytes
        self.evictions = 0
        self.evict_after_idle_s = evict_after_idle_s
        self._clock = clock
        self._on_remove = on_remove
        self._sessions: dict[str, Session] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why, bounded
        self._mutex = threading.Lock()
        # One open() at a time from taking a cache to admitting it: a slot pool holds one slot
        # beyond the session cap for the admission in progress (the victim's slot frees only
        # once it is evicted), so two admissions at once into a full store found the pool empty.
        self._admission = threading.Lock()

    def __len__(self) -> int:
        with self._mutex:
            return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        with self._mutex:
            return session_id in self._sessions

    def kv_tokens(self) -> int:
        with self._mutex:
            return sum(s.length for s in self._sessions.values())

    def kv_bytes(self) -> int:
        with self._mutex:
            return self._used_bytes()

    def open(self, owner: str | None = None) -> Session:
        self.expire_idle()
        with self._admission:
            cache = self._new_cache()
            need = self._cache_bytes(cache)
            if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
                raise ResourceExhausted(f"one session needs {need / 2**20:.0f} MiB of KV, above the whole budget "
                                        f"({self.kv_budget_bytes / 2**20:.0f} MiB); raise --kv-budget-mb")
            evicted: list[str] = []
            try:
                with self._mutex:
                    return self._admit(cache, need, owner, evicted)
            finally:
                for sid in evicted:  # before the next admission: what else holds a victim's slot lets go
                    self._on_remove(sid)

    def _admit(self, cache: Any, need: int, owner: str | None, evicted: list[str]) -> Session:
        """open() under the lock: evict idle sessions (their ids into `evicted`) until `need` fits."""
        while not self._fits(need):
            victim = self._least_recently_used_idle()
            if victim is None:
                raise ResourceExhausted(
                    f"no room for another session ({len(self._sessions)} live, max {self.max_sessions}; KV "
                    f"{self._used_bytes() / 2**20:.0f} MiB of {self._budget_mib()}) and every session has a "
                    f"call in flight, or was opened or had a call within {self.evict_after_idle_s:g} s; retry later"
                )
            del self._sessions[victim.session_id]
            self._forget(victim.session_id, "evicted (least recently used, to admit a new session)")
            evicted.append(victim.session_id)
            self.evictions += 1
            log.info("session evicted id=%s idle_s=%.1f", victim.session_id, self._clock() - victim.last_used)
        session = Session(session_id=secrets.token_urlsafe(18), cache=cache, seed=random_seed(), owner=owner)
        session.last_used = self._clock()
        self._sessions[session.session_id] = session
        log.debug("session open id=%s", session.session_id)
        return session

    def _used_bytes(self) -> int:
        return sum(self._cache_bytes(s.cache) for s in self._sessions.values())

    def _budget_mib(self) -> str:
        return "unlimited" if self.kv_budget_bytes is None else f"{self.kv_budget_bytes / 2**20:.0f} MiB"

    def _fits(self, need: int) -> bool:
        if len(self._sessions) >= self.max_sessions:
            return False
        return self.kv_budget_bytes is None or self._used_bytes() + need <= self.kv_budget_bytes

    def _least_recently_used_idle(self) -> Session | None:
        cutoff = self._clock() - self.evict_after_idle_s
        idle = [s for s in self._sessions.values() if not s.lock.locked() and s.last_used <= cutoff]
        return min(idle, key=lambda s: s.last_used, default=None)

    def close(self, session_id: str, owner: str | None = None) -> None:
        with self._mutex:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFound(self._why_missing(session_id))
            if not _owns(session, owner):
                raise SessionNotFound(_unknown(session_id))
            del self._sessions[session_id]
            session.closed = True
            self._forget(session_id, "closed")
        self._on_remove(session_id)
        log.debug("session close id=%s", session_id)

    def expire_idle(self) -> int:
        """Drop sessions idle for longer than the TTL; returns how many."""
        now = self._clock()
        with self._mutex:
            idle = [
                sid
                for sid, s in self._sessions.items()
                if now - s.last_used > self.ttl_s and not s.lock.locked()
            ]
            for sid in idle:
                del self._sessions[sid]
                self._forget(sid, f"expired after {self.ttl_s:g} s idle")
        for sid in idle:
            self._on_remove(sid)
        return len(idle)

    @contextlib.contextmanager
    def use(self, session_id: str, truncate_to: int, owner: str | None = None) -> Iterator[Session]:
        """Hold the session exclusively, truncated to `truncate_to` tokens. Someone else's
        session (see `Session.owner`) is NOT_FOUND, in the words of an unknown one.

        If the body raises, the cache is cropped back to `truncate_to` so the session
        stays consistent with what the client believes it holds.
        """
        with self._mutex:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFound(self._why_missing(session_id))
            if not _owns(session, owner):
                raise SessionNotFound(_unknown(session_id))
            if not session.lock.acquire(blocking=False):
                raise SessionBusy(f"session {session_id} already has a call in flight; calls on a session are sequential")
        try:
            if truncate_to < 0:
                raise InvalidArgument("truncate_to", f"must be >= 0, got {truncate_to}")
            if truncate_to > session.length:
                raise OutOfRange(
                    f"truncate_to={truncate_to} exceeds the session's KV length {session.length}; "
                    "it must be <= the kv_length returned by the previous call"
                )
            self._truncate(session, truncate_to)
            try:
                yield session
            except BaseException:
                self._truncate(session, truncate_to)
                raise
        finally:
            session.last_used = self._clock()
            session.lock.release()

    def _truncate(self, session: Session, length: int) -> None:
        self._crop(session.cache, length)
        session.length = length
        del session.tokens[length:]

    def _forget(self, session_id: str, why: str) -> None:
        self._gone[session_id] = why
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)

    def require(self, session_id: str) -> None:
        """SessionNotFound unless the session exists now: a cheap early answer before costly
        checks (use() still decides, owner included)."""
        if session_id not in self:
            with self._mutex:
                raise SessionNotFound(self._why_missing(session_id))

    def _why_missing(self, session_id: str) -> str:
        why = self._gone.get(session_id)
        if why:
            return f"session {session_id} was {why}; open a new session and re-prefill"
        return _unknown(session_id)


def _unknown(session_id: str) -> str:
    # Also the answer for someone else's session: the same words reveal nothing.
    return f"unknown session {display_id(session_id)}; open one with OpenSession"


def _owns(session: Session, owner: str | None) -> bool:
    if session.owner is None:
        return True
    return owner is not None and hmac.compare_digest(session.owner.encode(), owner.encode())
