"""Per-session KV caches: open / close, truncation, idle TTL and a session cap.

State lives here, not in the gRPC layer. A session is used by one call at a time: a
second concurrent call on it is refused (SessionBusy) rather than interleaved, and a
call that fails midway restores the cache to the length it truncated to, so the
client's bookkeeping stays valid.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy, SessionNotFound
from specdec.sampling import random_seed

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    cache: Any  # the model's KV cache object
    seed: int  # server randomness for requests without a seed
    length: int = 0  # tokens held in the KV cache
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore:
    """Sessions by unguessable id, with an idle TTL and a cap on live sessions."""

    def __init__(
        self,
        new_cache: Callable[[], Any],
        crop: Callable[[Any, int], None],
        *,
        max_sessions: int = 256,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._new_cache = new_cache
        self._crop = crop
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why, bounded
        self._mutex = threading.Lock()

    def __len__(self) -> int:
        with self._mutex:
            return len(self._sessions)

    def kv_tokens(self) -> int:
        with self._mutex:
            return sum(s.length for s in self._sessions.values())

    def open(self) -> Session:
        self.expire_idle()
        with self._mutex:
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(
                    f"session limit reached ({self.max_sessions} live sessions); close sessions or retry later"
                )
            session = Session(session_id=secrets.token_urlsafe(18), cache=self._new_cache(), seed=random_seed())
            session.last_used = self._clock()
            self._sessions[session.session_id] = session
        log.debug("session open id=%s", session.session_id)
        return session

    def close(self, session_id: str) -> None:
        with self._mutex:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionNotFound(self._why_missing(session_id))
            self._forget(session_id, "closed")
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
        return len(idle)

    @contextlib.contextmanager
    def use(self, session_id: str, truncate_to: int) -> Iterator[Session]:
        """Hold the session exclusively, truncated to `truncate_to` tokens.

        If the body raises, the cache is cropped back to `truncate_to` so the session
        stays consistent with what the client believes it holds.
        """
        with self._mutex:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFound(self._why_missing(session_id))
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
            self._crop(session.cache, truncate_to)
            session.length = truncate_to
            try:
                yield session
            except BaseException:
                self._crop(session.cache, truncate_to)
                session.length = truncate_to
                raise
        finally:
            session.last_used = self._clock()
            session.lock.release()

    def _forget(self, session_id: str, why: str) -> None:
        self._gone[session_id] = why
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)

    def _why_missing(self, session_id: str) -> str:
        why = self._gone.get(session_id)
        if why:
            return f"session {session_id} was {why}; open a new session and re-prefill"
        return f"unknown session {session_id!r}; open one with OpenSession"
