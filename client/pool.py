"""A pool of drafter or verifier servers behind one client: which server a new session
goes to, and which servers are skipped for a while after they failed.

Pure bookkeeping (no gRPC call in here): SpeculativeClient opens and loses the sessions
and reports back with `release`, `failed`, `succeeded` and `disable`.

Balancing signal: the live sessions *this client* has open on each server. The servers'
own GetStats `live_sessions` would also see other clients, but it costs a call per pick
(or a poller and its staleness) and counts idle sessions that wait for their TTL; a
client's own count is exact, free and updated the moment a session opens or ends. Ties go
to the server that was given the fewest sessions so far, so generations run one at a time
also spread over the pool.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Collection, Generic, Sequence, TypeVar

from specdec.argtypes import check_port

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.25, 4.0
# A server left out (it served another model) is asked again this often: a redeploy of the
# right model brings it back into a long-lived client (the gateway) without a restart.
RECHECK_LEFT_OUT_S = 30.0
_ROOM_POLL_S = 0.02  # how often a generation queued for a full pool looks again

StubT = TypeVar("StubT")


def parse_addresses(value: str | Sequence[str] | None, role: str) -> list[str]:
    """HOST:PORT addresses from one string, a comma-separated string or a sequence of
    either: `"a:1"`, `"a:1,b:2"`, `["a:1", "b:2,c:3"]`. Empty -> []; a repeat is refused."""
    if value is None:
        return []
    parts = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for part in parts:
        for address in str(part).split(","):
            address = address.strip()
            if not address:
                continue
            check_port(address, role)
            if address in out:
                raise ValueError(f"{role} address {address} is listed twice")
            out.append(address)
    return out


@dataclass(eq=False)
class Server(Generic[StubT]):
    """One server of a pool, as this client sees it."""

    address: str
    stub: StubT  # blocking calls (health probes, GetStats)
    astub: object = None  # the `grpc.aio` stub the client's event loop calls
    index: int = 0  # position in the pool, the last tie-breaker
    info: object | None = None  # its ModelInfo once it answered and passed the checks; None: check it first
    sessions: int = 0  # live sessions of this client on it: the balancing signal
    capacity: int = 0  # the sessions it admits at once (ModelInfo.max_sessions); 0: unbounded
    opened: int = 0  # sessions given to it so far: breaks ties between equal loads
    down: bool = False  # failed last time; tried again once retry_at has passed
    retry_at: float = 0.0  # clock() time of the next try while down
    probing: bool = False  # down, and one session was given it as the retry
    backoff_s: float = BACKOFF_MIN_S
    disabled: str | None = None  # why it is left out (it no longer fits the pool); re-checked at recheck_at
    recheck_at: float = 0.0  # clock() time of the next check of a left-out server's model


class ServerPool(Generic[StubT]):
    """Servers of one role; thread-safe (concurrent generations share it).

    >>> pool = ServerPool("drafter", [Server("a:1", None), Server("b:2", None)])
    >>> first, second = pool.pick(), pool.pick()
    >>> (first.address, second.address)
    ('a:1', 'b:2')
    """

    def __init__(self, role: str, servers: Sequence[Server[StubT]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not servers:
            raise ValueError(f"a {role} pool needs at least one address")
        self.role = role
        self.servers = list(servers)
        for i, server in enumerate(self.servers):
            server.index = i
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: collections.deque[object] = collections.deque()  # wait_for_room's tickets, first come first

    def __len__(self) -> int:
        return len(self.servers)

    def pick(self, exclude: Collection[Server[StubT]] = (), retry_down: bool = True) -> Server[StubT] | None:
        """The server for a new session, its slot taken (give it back with `release`): of
        the enabled servers not in `exclude` that are up, the one with the fewest live
        sessions; only if none is up (and `retry_down`), one that is down and due for a retry.
        None if there is none. A down server that is picked is claimed for one retry, so
        concurrent generations do not all probe it at once; while another server is up, a down
        one is retried off the generations' path (`claim_due`): a hung one made every retry
        wait its whole deadline. A server that holds as many of this client's sessions as it
        admits is not picked: past that it would evict this client's idle sessions, each to be
        re-prefilled (see `wait_for_room`)."""
        with self._lock:
            now = self._clock()
            ready = [s for s in self.servers
                     if s.disabled is None and s not in exclude and (not s.down or now >= s.retry_at)
                     and not _full(s)]
            up = [s for s in ready if not s.down]
            ready = up or (ready if retry_down else [])
            if not ready:
                return None
            server = min(ready, key=lambda s: (s.sessions, s.opened, s.index))
            if server.down:
                server.retry_at, server.probing = now + server.backoff_s, True
            server.sessions += 1
            server.opened += 1
            return server

    def claim_due(self, always: bool = False) -> list[Server[StubT]]:
        """Down servers due for a retry, each claimed for one probe off the generations' path
        (report it with `succeeded` or `failed`): while another server is up, or `always`; and
        the left-out servers due for a check of their model (`succeeded` takes one back)."""
        with self._lock:
            now = self._clock()
            # (left-out servers whatever `always` says: with every verifier left out, none is up)
            left_out = [s for s in self.servers if s.disabled is not None and now >= s.recheck_at]
            for s in left_out:
                s.recheck_at = now + RECHECK_LEFT_OUT_S
            if not always and not any(s.disabled is None and not s.down for s in self.servers):
                return left_out
            due = [s for s in self.servers if s.disabled is None and s.down and not s.probing and now >= s.retry_at]
            for s in due:
                s.retry_at, s.probing = now + s.backoff_s, True
            return due + left_out

    def release(self, server: Server[StubT]) -> None:
        """A session picked on `server` ended (closed, lost, or never opened)."""
        with self._lock:
            server.sessions = max(0, server.sessions - 1)

    def failed(self, server: Server[StubT], *, immediate: bool = False) -> None:
        """A call to `server` failed: check its model again before the next session there;
        unless `immediate` (it answered, only the session was gone), skip it for its backoff
        (0.25 s doubling to 4 s; reset by `succeeded`)."""
        with self._lock:
            server.info = None
            if immediate:
                return
            if server.down and not server.probing:
                return  # another session lost in the same outage: the backoff already runs
            server.retry_at = self._clock() + server.backoff_s
            server.backoff_s = min(2 * server.backoff_s, BACKOFF_MAX_S)
            server.down, server.probing = True, False

    def succeeded(self, server: Server[StubT], info: object) -> None:
        """`server` answered (and its `info` passed the checks): it is up again."""
        with self._lock:
            server.info, server.down, server.probing, server.disabled = info, False, False, None
            server.retry_at, server.backoff_s = 0.0, BACKOFF_MIN_S
            server.capacity = getattr(info, "max_sessions", 0)

    def disable(self, server: Server[StubT], reason: str) -> None:
        """Leave `server` out (e.g. it came back serving another model): never picked, its model
        checked again every RECHECK_LEFT_OUT_S by `claim_due`'s callers."""
        with self._lock:
            server.disabled, server.info = reason, None
            server.recheck_at = self._clock() + RECHECK_LEFT_OUT_S

    def retry_by(self, when: float) -> None:
        """Make every down server due for a retry by `when` (clock time) at the latest: a
        caller's last try before its deadline, whatever the backoff left."""
        with self._lock:
            for s in self.servers:
                if s.disabled is None and s.down and not s.probing:
                    s.retry_at = min(s.retry_at, when)

    def wait_s(self) -> float | None:
        """Seconds until `pick` may find a server (0: now); None if every server is disabled."""
        with self._lock:
            now = self._clock()
            waits = [max(0.0, s.retry_at - now) if s.down else 0.0 for s in self.servers if s.disabled is None]
            return min(waits) if waits else None

    def full(self) -> bool:
        """Every enabled server holds as many of this client's sessions as it admits."""
        with self._lock:
            return self._all_full()

    def queued(self) -> int:
        """Generations in line now (in `wait_for_room`, or refused by shared servers)."""
        return len(self._queue)

    def enqueue(self) -> object:
        """A place at the end of the line (a ticket): give it back with `dequeue`."""
        ticket = object()
        self._queue.append(ticket)
        return ticket

    def first(self, ticket: object) -> bool:
        return bool(self._queue) and self._queue[0] is ticket

    def dequeue(self, ticket: object) -> None:
        if ticket in self._queue:
            self._queue.remove(ticket)

    async def wait_for_room(self, timeout_s: float) -> bool:
        """Wait (on the client's event loop) until this caller is first in line and a server
        has room, or timeout_s passes; False then. (The queue in front of full servers, first
        come first served as vLLM's waiting queue: waiters that all polled took a freed session
        in whatever order they woke, and a request sent 3 s later finished 12 s sooner.) The
        caller picks its server before its next await, so the next in line sees the room taken.
        Polls: room frees when a generation ends, seconds apart."""
        deadline = time.monotonic() + timeout_s  # real time (not the backoff's clock)
        ticket = self.enqueue()
        try:
            while not self.first(ticket) or self.full():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                await asyncio.sleep(min(left, _ROOM_POLL_S))
            return True
        finally:
            self.dequeue(ticket)

    def _all_full(self) -> bool:  # under the lock
        enabled = [s for s in self.servers if s.disabled is None]
        return bool(enabled) and all(map(_full, enabled))

    def live_sessions(self) -> dict[str, int]:
        """{address: live sessions of this client}, e.g. for logs and tests."""
        with self._lock:
            return {s.address: s.sessions for s in self.servers}


def _full(server: Server) -> bool:
    return bool(server.capacity) and server.sessions >= server.capacity
