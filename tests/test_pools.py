"""Drafter and verifier pools (M:N): the pool's pick / balance / backoff logic on its own,
then real processes: a drafter and a verifier killed mid-run while concurrent generations
use pools. The committed tokens are the source of truth, so a session that moves to
another server is re-prefilled and greedy output stays token-identical to target-only."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import concurrent.futures
import socket
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from client.launcher import start_service
from client.pool import BACKOFF_MAX_S, BACKOFF_MIN_S, Server, ServerPool, parse_addresses
from client.speculative import (GenerationResult, IncompatibleModels, NoServerAvailable, SpeculativeClient,
                                _check_same_target)
from specdec.sampling import SamplingParams
from specdec.serving import ModelInfo
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.ops import RECONNECT_BACKOFF_MAX_S
from tests.conftest import free_port, stream_concurrently, target_only_outputs, wait_for

ARGS = ["--max-draft-tokens", "8", "--log-level", "WARNING"]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n", "Water boils at"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pool(n: int, clock: FakeClock | None = None) -> ServerPool:
    return ServerPool("drafter", [Server(f"h{i}:1", stub=None) for i in range(n)], clock=clock or FakeClock())


# ---- the pool on its own -------------------------------------------------------------------


def test_addresses_come_from_strings_commas_and_sequences_and_a_repeat_is_refused():
    assert parse_addresses("a:1", "drafter") == ["a:1"]
    assert parse_addresses(" a:1, b:2 ,", "drafter") == ["a:1", "b:2"]
    assert parse_addresses(["a:1", "b:2,c:3"], "verifier") == ["a:1", "b:2", "c:3"]
    assert parse_addresses(None, "drafter") == [] and parse_addresses("", "drafter") == []
    with pytest.raises(ValueError, match="b:2 is listed twice"):
        parse_addresses("a:1,b:2,b:2", "drafter")


@pytest.mark.parametrize("address", ["[::1]:50051", "dns:///svc.local:50051", "unix:/tmp/verifier.sock"])
def test_ipv6_and_grpc_target_schemes_are_addresses(address):
    assert parse_addresses(address, "verifier") == [address]


@pytest.mark.parametrize("address,expected", [("10.0.0.5", "needs a port"), ("::1", "needs a port"),
                                              ("[::1]", "needs a port"), ("host:0", "must be in 1-65535"),
                                              ("host:http", "must be in 1-65535"), ("a:1,b", "'b' needs a port")])
def test_an_address_without_a_usable_port_is_refused_not_dialled_on_443(address, expected):
    with pytest.raises(ValueError, match=expected):
        parse_addresses(address, "verifier")


def test_new_sessions_go_to_the_server_with_the_fewest_live_sessions():
    pool = _pool(3)
    picked = [pool.pick() for _ in range(7)]
    assert sorted(pool.live_sessions().values()) == [2, 2, 3]
    assert collections.Counter(s.address for s in picked) == {"h0:1": 3, "h1:1": 2, "h2:1": 2}
    for s in picked:
        if s.address == "h2:1":
            pool.release(s)  # h2's sessions end: it is the least loaded now
    assert pool.pick().address == "h2:1"


def test_a_server_holding_all_the_sessions_it_admits_is_not_picked_and_a_release_wakes_a_waiter():
    pool = _pool(2)
    for server, capacity in zip(pool.servers, (1, 2)):
        pool.succeeded(server, SimpleNamespace(max_sessions=capacity))
    held = [pool.pick() for _ in range(3)]
    assert sorted(s.address for s in held) == ["h0:1", "h1:1", "h1:1"] and pool.full()
    assert pool.pick() is None and not asyncio.run(pool.wait_for_room(0.05))

    async def wait_while_one_ends() -> tuple[bool, bool]:
        waiter = asyncio.ensure_future(pool.wait_for_room(30))
        await asyncio.sleep(0.1)
        waited = not waiter.done()  # still waiting
        pool.release(held[0])
        return waited, await asyncio.wait_for(waiter, 10)

    assert asyncio.run(wait_while_one_ends()) == (True, True)
    assert not pool.full() and pool.pick() is held[0]
    pool.succeeded(pool.servers[0], SimpleNamespace(max_sessions=0))  # 0: the server does not say
    assert pool.pick().address == "h0:1"


def test_ties_go_to_the_server_given_the_fewest_sessions_so_one_at_a_time_use_spreads():
    pool = _pool(3)
    order = []
    for _ in range(6):
        s = pool.pick()
        order.append(s.address)
        pool.release(s)
    assert order == ["h0:1", "h1:1", "h2:1", "h0:1", "h1:1", "h2:1"]


def test_a_failed_server_is_skipped_for_its_backoff_then_one_session_probes_it():
    clock = FakeClock()
    pool = _pool(2, clock)
    a, b = pool.pick(), pool.pick()
    pool.release(a)
    pool.failed(a)
    assert a.info is None and a.down
    assert [pool.pick().address for _ in range(3)] == ["h1:1"] * 3  # a is skipped though b is busier
    assert pool.wait_s() == 0.0  # b can be picked now
    assert pool.pick(exclude=[b]) is None
    clock.now += BACKOFF_MIN_S
    probe = pool.pick(exclude=[b])
    assert probe is a and pool.pick(exclude=[b]) is None  # claimed by one session only
    pool.release(a)
    pool.failed(a)  # the probe failed: the backoff doubles
    clock.now += BACKOFF_MIN_S
    assert pool.pick(exclude=[b]) is None
    clock.now += BACKOFF_MIN_S
    assert pool.pick(exclude=[b]) is a
    pool.succeeded(a, info="model")
    assert not a.down and a.backoff_s == BACKOFF_MIN_S and a.info == "model"


def test_a_due_server_is_retried_off_the_path_while_another_is_up():
    """While a server is up, a down one due for its retry is not given a generation's session
    (a hung server made that session wait its whole deadline, every backoff period): it is
    claimed once for a background probe instead. With none up, a session retries it in its path
    (the verifier has nowhere else to go) unless told not to (drafts are optional)."""
    clock = FakeClock()
    pool = _pool(2, clock)
    a, b = pool.pick(), pool.pick()
    pool.release(a)
    pool.failed(a)
    clock.now += BACKOFF_MIN_S
    assert [pool.pick() for _ in range(3)] == [b, b, b]  # a is due, but b is up
    assert pool.claim_due() == [a] and pool.claim_due() == []  # one probe at a time
    pool.failed(a)  # the probe failed: backoff doubled, due again later
    clock.now += 2 * BACKOFF_MIN_S
    pool.failed(b)
    assert pool.claim_due() == []  # nothing up: a session's own retry is the only way
    assert pool.pick(retry_down=False) is None
    clock.now += BACKOFF_MAX_S
    assert pool.claim_due(always=True) == [a, b]


def test_a_last_try_at_the_deadline_overrides_the_backoff():
    """A generation waiting for its verifier gave up as soon as the backoff (up to 4 s) put the
    next try past its recovery deadline, though the verifier came back within it: retry_by
    makes every down server due by the deadline for one last try."""
    clock = FakeClock()
    pool = _pool(2, clock)
    a, b = pool.pick(), pool.pick()
    for server in (a, b):
        pool.release(server)
        for _ in range(5):
            server.probing = True  # each failure a probe's: the backoff doubles up to the cap
            pool.failed(server)
    assert pool.wait_s() > 2.0
    pool.retry_by(clock.now + 1.5)
    assert pool.wait_s() == 1.5 and pool.pick() is None
    clock.now += 1.5
    assert pool.pick() in (a, b)
    pool.retry_by(clock.now + 100.0)  # never later than the backoff's own time
    assert pool.wait_s() <= BACKOFF_MAX_S


def test_generations_queued_for_a_full_pool_get_room_first_come_first_served():
    """Eight generations queue, 30 ms apart, for a pool whose one server admits one session;
    each freed session goes to the longest waiting. Polling alone let whichever woke first
    take it (a hunt: a request sent 3 s later finished 12 s sooner)."""
    pool = _pool(1)
    server = pool.servers[0]
    pool.succeeded(server, SimpleNamespace(max_sessions=1))
    held = pool.pick()
    order: list[int] = []

    async def generation(i: int) -> None:
        assert await pool.wait_for_room(30)
        assert pool.pick() is server  # picked before the next await: the next in line sees it taken
        order.append(i)
        await asyncio.sleep(0.01 * (8 - i))  # shorter and shorter: later waiters poll at other phases
        pool.release(server)

    async def main() -> None:
        tasks = []
        for i in range(8):
            tasks.append(asyncio.create_task(generation(i)))
            await asyncio.sleep(0.03)
        assert pool.queued() == 8
        pool.release(held)
        await asyncio.gather(*tasks)
        assert pool.queued() == 0
        late = pool.pick()
        assert not await pool.wait_for_room(0.1)  # full, and the wait is bounded
        pool.release(late)

    asyncio.run(main())
    assert order == list(range(8))


def test_sessions_lost_in_one_outage_do_not_compound_the_backoff():
    clock = FakeClock()
    pool = _pool(1, clock)
    server = pool.servers[0]
    for _ in range(4):
        pool.pick()
    for _ in range(4):  # all four sessions fail together
        pool.release(server)
        pool.failed(server)
    assert server.retry_at == clock.now + BACKOFF_MIN_S and pool.wait_s() == BACKOFF_MIN_S
    for _ in range(10):  # failed probes double it up to the cap
        clock.now = server.retry_at
        pool.release(pool.pick())
        pool.failed(server)
    assert server.backoff_s == BACKOFF_MAX_S


def test_a_lost_session_on_a_live_server_only_asks_for_a_model_recheck():
    pool = _pool(1)
    server = pool.pick()
    pool.succeeded(server, info="model")
    pool.release(server)
    pool.failed(server, immediate=True)  # NOT_FOUND: the server answered, the session was gone
    assert server.info is None and not server.down and pool.pick() is server


def test_a_disabled_server_is_never_picked_and_an_all_disabled_pool_says_so():
    pool = _pool(2)
    pool.disable(pool.servers[0], "serves another model")
    assert [pool.pick().address for _ in range(3)] == ["h1:1"] * 3
    pool.disable(pool.servers[1], "serves another model")
    assert pool.pick() is None and pool.wait_s() is None


def test_a_left_out_server_is_checked_again_and_taken_back_once_it_fits():
    """A redeploy of the right model brings a left-out server back to a long-lived client (the
    gateway dropped a drafter for good after one bad redeploy, and sent no drafts after the fix)."""
    from client.pool import RECHECK_LEFT_OUT_S

    clock = FakeClock()
    pool = _pool(2, clock)
    left = pool.servers[0]
    pool.disable(left, "serves another model")
    assert pool.claim_due(always=True) == []  # not due yet
    clock.now += RECHECK_LEFT_OUT_S
    assert pool.claim_due(always=True) == [left] and pool.claim_due(always=True) == []  # one check at a time
    pool.disable(left, "still another model")  # the check found it still does not fit
    assert pool.pick(exclude=[pool.servers[1]]) is None
    clock.now += RECHECK_LEFT_OUT_S
    assert pool.claim_due(always=True) == [left]
    pool.succeeded(left, object())  # it fits again
    assert left.disabled is None and pool.pick(exclude=[pool.servers[1]]) is left
    for server in pool.servers:  # every server left out: nothing is up, and they are checked all the same
        pool.disable(server, "another model")
    clock.now += RECHECK_LEFT_OUT_S
    assert pool.claim_due(always=False) == pool.servers


def test_verifiers_of_one_pool_must_serve_the_same_target():
    info = ModelInfo(role="verifier", model="m", vocab_size=10, eos_token_ids=(0,), max_context=64,
                     tokenizer_fingerprint="f" * 64, tokenizer_source="m", dtype="float32", device="cpu",
                     max_draft_tokens=8)
    _check_same_target(info, info)
    for change in ({"model": "other"}, {"vocab_size": 11}, {"tokenizer_fingerprint": "e" * 64}):
        with pytest.raises(IncompatibleModels):
            _check_same_target(ModelInfo(**{**info.__dict__, **change}), info)


# ---- real processes -------------------------------------------------------------------------


@pytest.mark.slow
def test_swapped_drafter_and_verifier_addresses_are_named_not_reported_as_unimplemented(verifier_proc,
                                                                                         drafter_proc):
    with pytest.raises(IncompatibleModels, match=f"{drafter_proc.address} does not serve the verifier API.*drafter"):
        SpeculativeClient(drafter=verifier_proc.address, verifier=drafter_proc.address)
    with pytest.raises(IncompatibleModels, match=f"{verifier_proc.address} does not serve the drafter API.*verifier"):
        SpeculativeClient(drafter=verifier_proc.address, verifier=verifier_proc.address)


@pytest.mark.slow
def test_a_client_whose_only_drafter_is_down_starts_target_only_and_speculates_once_it_is_up(verifier_proc):
    """A drafter that is not up yet (a container still loading) must not keep the client, or a
    gateway in front of it, from serving: generations run target-only, and speculation starts
    by itself once the drafter answers."""
    late = f"127.0.0.1:{free_port()}"
    drafter = None
    try:
        with SpeculativeClient(verifier_proc.address, drafter=late) as client:
            assert client.drafter_info is None and client.drafters.servers[0].down
            expected = client.generate(PROMPTS[0], GREEDY.replace(max_tokens=12), target_only=True).token_ids
            alone = client.generate(PROMPTS[0], GREEDY.replace(max_tokens=12), num_speculative_tokens=4)
            assert alone.token_ids == expected and alone.num_draft_tokens == 0
            drafter = start_service("drafter", ARGS, port=int(late.rsplit(":", 1)[1]), threads=1)
            wait_for(lambda: client.generate(PROMPTS[0], GREEDY.replace(max_tokens=12),
                                             num_speculative_tokens=4).num_draft_tokens > 0,
                     60, "speculation to start once the drafter answers")
            later = client.generate(PROMPTS[0], GREEDY.replace(max_tokens=12), num_speculative_tokens=4)
            assert later.token_ids == expected and later.drafter_addresses == [late]
            assert client.drafter_info is not None and client.drafter_info.role == "drafter"
    finally:
        if drafter is not None:
            drafter.kill()


@pytest.mark.slow
def test_drafter_pool_takes_a_late_drafter_balances_and_moves_a_killed_drafters_sessions(verifier_proc,
                                                                                          drafter_proc):
    """2 drafters + 1 verifier. The first drafter is down when the client starts (tolerated,
    retried once it is up); 6 concurrent greedy generations are split 3/3; the first
    drafter is SIGKILLed mid-run: its sessions move to the other drafter in the same round
    (re-prefilled) and keep drafting, and every output equals target-only decoding."""
    late = f"127.0.0.1:{free_port()}"
    doomed = None
    try:
        with SpeculativeClient(verifier_proc.address, drafter=[late, drafter_proc.address]) as client:
            assert client.drafters.servers[0].down  # not there yet: the client started anyway
            doomed = start_service("drafter", ARGS, port=int(late.rsplit(":", 1)[1]), threads=1)
            # A generation opens its drafter session when it first drafts (its second round).
            wait_for(lambda: client.generate(PROMPTS[0], GREEDY.replace(max_tokens=8),
                                             num_speculative_tokens=4).drafter_addresses == [late],
                     60, "the late drafter to take a session")
            expected = target_only_outputs(client, PROMPTS, GREEDY)
            progress: collections.Counter = collections.Counter()
            chunks: dict[int, list] = collections.defaultdict(list)
            results, threads = stream_concurrently(client, [(p, GREEDY) for p in PROMPTS], progress, chunks)
            wait_for(lambda: len(progress) == len(PROMPTS) and min(progress.values()) >= 2, 120,
                     "a drafting round of every generation")
            live_at_kill = client.drafters.live_sessions()
            killed_at = time.monotonic()
            doomed.kill()  # SIGKILL
            for t in threads:
                t.join(300)

        assert all(isinstance(r, GenerationResult) for r in results), results
        assert [r.token_ids for r in results] == expected
        first = collections.Counter(r.drafter_addresses[0] for r in results)
        assert first == {late: 3, drafter_proc.address: 3}, first  # balanced by live sessions
        assert live_at_kill[late] >= 1 and live_at_kill[drafter_proc.address] >= 1, live_at_kill
        moved = [i for i, r in enumerate(results) if r.drafter_addresses[0] == late]
        for i in moved:
            r = results[i]
            assert r.drafter_failures >= 1 and r.drafter_failovers == 1, r.to_dict()
            assert r.drafter_addresses == [late, drafter_proc.address]
            rounds_after = sum(1 for t, _ in chunks[i] if t > killed_at)
            # Counters: fewer fallback rounds than rounds after the kill, i.e. some of them had drafts.
            assert r.drafter_fallback_rounds < rounds_after, (r.drafter_fallback_rounds, rounds_after)
        drafted_after = [sum(1 for t, n in chunks[i] if t > killed_at and n > 1) for i in moved]
        assert sum(drafted_after) > 0  # rounds that emitted accepted drafts, after the kill
        stay = [r for r in results if r.drafter_addresses[0] == drafter_proc.address]
        assert all(r.drafter_failovers == 0 and r.drafter_fallback_rounds == 0 for r in stay)
        print(f"drafter pool kill: {len(results)} generations, {sum(map(len, expected))} tokens identical to "
              f"target-only; live sessions at the kill {live_at_kill}; moved {len(moved)}; rounds with accepted "
              f"drafts after the kill {drafted_after}; fallback rounds "
              f"{[results[i].drafter_fallback_rounds for i in moved]}")
    finally:
        if doomed is not None:
            doomed.kill()


@pytest.mark.slow
def test_verifier_pool_moves_a_killed_verifiers_sessions_and_outputs_do_not_change(verifier_proc,
                                                                                    int8_drafter_proc):
    """1 drafter + 2 verifiers, 3 greedy and 3 seeded generations at once; one verifier is
    SIGKILLed mid-run: its sessions move to the other one and are re-prefilled; greedy
    outputs equal target-only decoding and seeded outputs equal the same seeded runs
    without a failure (the verifier's draws depend on the seed and position only). The
    drafter must give a row the same proposal whatever its batch mates: the int8 drafter
    runs rows one at a time; float16's batched matmul on an AVX512-FP16 CPU does not keep
    a row's bits, and its seeded outputs then moved with the batching."""
    doomed = start_service("verifier", ARGS, threads=1)
    try:
        with SpeculativeClient([verifier_proc.address, doomed.address], drafter=int8_drafter_proc.address,
                               recovery_timeout_s=120) as client:
            prompts = PROMPTS[:3]
            expected = target_only_outputs(client, prompts, GREEDY)
            seeded_ref = [client.generate(p, SEEDED, num_speculative_tokens=4).token_ids for p in prompts]
            jobs = [(p, GREEDY) for p in prompts] + [(p, SEEDED) for p in prompts]
            progress: collections.Counter = collections.Counter()
            chunks: dict[int, list] = collections.defaultdict(list)
            results, threads = stream_concurrently(client, jobs, progress, chunks)
            wait_for(lambda: len(progress) == len(jobs), 120, "a first round of every generation")
            live_at_kill = client.verifiers.live_sessions()
            doomed.kill()  # SIGKILL
            for t in threads:
                t.join(300)

        assert all(isinstance(r, GenerationResult) for r in results), results
        assert [r.token_ids for r in results] == expected + seeded_ref
        first = collections.Counter(r.verifier_addresses[0] for r in results)
        assert first == {verifier_proc.address: 3, doomed.address: 3}, first
        moved = [i for i, r in enumerate(results) if r.verifier_addresses[0] == doomed.address]
        for i in moved:
            r = results[i]
            assert r.verifier_recoveries == 1 and r.verifier_failovers == 1, r.to_dict()
            assert r.verifier_addresses == [doomed.address, verifier_proc.address]
        assert all(r.num_draft_tokens > 0 and r.drafter_failures == 0 for r in results)
        print(f"verifier pool kill: {len(results)} generations ({sum(map(len, expected + seeded_ref))} tokens) "
              f"identical; live sessions at the kill {live_at_kill}; moved {len(moved)} "
              f"(seeded among them: {sum(1 for i in moved if i >= len(prompts))})")
    finally:
        doomed.kill()


@pytest.mark.slow
def test_a_pool_whose_every_verifier_is_gone_fails_the_generation_with_no_server_available():
    """The only verifier is SIGKILLed mid-generation and stays down: after recovery_timeout_s the
    caller gets NoServerAvailable (a ConnectionError) naming the pool and the last status, the
    same exception as when none could be tried, not gRPC's raw AioRpcError."""
    doomed = start_service("verifier", ARGS, threads=1)
    try:
        with SpeculativeClient(doomed.address, recovery_timeout_s=1.0) as client:
            stream = client.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                                   target_only=True)
            next(stream)
            doomed.kill()
            start = time.monotonic()
            with pytest.raises(NoServerAvailable, match=f"no verifier of {doomed.address} answered within 1 s; "
                                                        "the last error: UNAVAILABLE") as caught:
                for _ in stream:
                    pass
            assert isinstance(caught.value, ConnectionError) and isinstance(caught.value.__cause__, grpc.RpcError)
            assert time.monotonic() - start < 30
    finally:
        doomed.kill()


def test_the_last_try_asks_every_down_verifier_at_once():
    """At the recovery deadline the last try waits for each down verifier's channel to
    reconnect (up to RECONNECT_BACKOFF_MAX_S + 1 = 3 s). It asked them one after another: a pool
    of a killed verifier and three dead addresses failed after 14 s against a recovery_timeout_s
    of 2 (2 + 4 x 3). Asked at once, the pool costs one wait."""
    doomed = start_service("verifier", ARGS, threads=1)
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    try:
        with SpeculativeClient([doomed.address, *dead], recovery_timeout_s=2.0) as client:
            stream = client.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                                   target_only=True)
            next(stream)
            doomed.kill()
            start = time.monotonic()
            with pytest.raises(NoServerAvailable, match="answered within 2 s"):
                for _ in stream:
                    pass
            elapsed = time.monotonic() - start
    finally:
        doomed.kill()
    assert elapsed < 2.0 + 2 * 3.0, elapsed  # one 3 s wait, with room for a loaded host; not four


def test_a_client_whose_every_verifier_is_down_at_start_raises_no_server_available():
    """Construction against a pool of which no verifier answers raises the same NoServerAvailable
    (a ConnectionError) as a generation whose verifiers are gone, naming every address and the
    first status; it was the first probe's raw AioRpcError."""
    down = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with pytest.raises(NoServerAvailable, match=f"no verifier of {down[0]}, {down[1]} answered at start; "
                                                "the first error: UNAVAILABLE") as caught:
        SpeculativeClient(down, timeout_s=5.0)
    assert isinstance(caught.value, ConnectionError) and isinstance(caught.value.__cause__, grpc.RpcError)


class _Switch:
    """A loopback port in front of a real verifier that goes down (refusing connections and
    cutting the open ones) and comes back at once: a restart without the model load, so the
    test controls when in a recovery window the verifier is back."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.port = (host, int(port)), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() below
        self._listener.close()
        with self._lock:
            cut, self._open = self._open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                near, _ = listener.accept()
            except OSError:
                return
            far = socket.create_connection(self.upstream)
            with self._lock:
                self._open += [near, far]
            for src, dst in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


def test_a_verifier_back_just_before_the_recovery_deadline_is_found_by_the_last_try(verifier_proc):
    """The verifier is down when a generation starts and back 0.4 s before its recovery
    deadline. The pool's backoff puts its next try past the deadline, so the last try comes at
    the deadline; the channel's own reconnect backoff (up to 2 s) had failed that try at once
    (UNAVAILABLE, the gateway's 503) although the verifier had been back for a while. It now
    waits for the channel's next reconnect attempt, and the generation completes unchanged.
    The bound is on its first token: the rounds after it measure the host's speed, not the
    reconnect (beside another pytest worker they once took the whole generation past it)."""
    window = 4.0
    switch = _Switch(verifier_proc.address)
    switch.up()

    def late_generation(start: float) -> tuple[float, list[int]]:
        """(seconds from `start` to the first token, the generation's tokens)."""
        first, result = None, None
        for chunk in client.stream(PROMPTS[0], GREEDY, target_only=True):
            first = first or time.monotonic() - start
            result = chunk.result or result
        return first, result.token_ids

    try:
        with SpeculativeClient(switch.address, recovery_timeout_s=window) as client:
            expected = client.generate(PROMPTS[0], GREEDY, target_only=True).token_ids
            switch.down()
            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                late = pool.submit(late_generation, start)
                time.sleep(window - 0.4)
                switch.up()
                first_token_s, tokens = late.result(timeout=60)
            assert tokens == expected
            assert first_token_s < window + RECONNECT_BACKOFF_MAX_S + 3.0
    finally:
        with contextlib.suppress(OSError, AttributeError):
            switch.down()


@pytest.mark.slow
def test_a_hung_verifier_is_failed_over_within_the_keepalive_not_the_calls_deadline(verifier_proc,
                                                                                    int8_drafter_proc):
    """The verifier serving a greedy generation stops (SIGSTOP: a wedged process, not a closed
    port). With the default deadline (60 s) and recovery window (10 s) the generation used to
    wait 60 s, then fail, the healthy verifier never tried (the window had started before the
    call). The channel's keepalive now notices within ~20 s, the session moves, and the output
    is target-only's. Once the process resumes, the session it still holds is closed by the
    client's background retries (UNAVAILABLE "ping timeout" is no proof it is gone), at the
    latest when the client closes, not left for its 10-minute TTL."""
    import signal

    hung = start_service("verifier", ARGS, threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    try:
        with SpeculativeClient(verifier_proc.address) as alone:
            expected = alone.generate(PROMPTS[2], params, target_only=True).token_ids
        with SpeculativeClient([hung.address, verifier_proc.address], drafter=int8_drafter_proc.address,
                               recovery_timeout_s=10) as client:  # (the first session goes to the first listed)
            progress: collections.Counter = collections.Counter()
            results, threads = stream_concurrently(client, [(PROMPTS[2], params)], progress)
            wait_for(lambda: progress[0] >= 2, 120, "the generation's first rounds")
            stopped = time.monotonic()
            hung.proc.send_signal(signal.SIGSTOP)
            threads[0].join(120)
            waited = time.monotonic() - stopped
            hung.proc.send_signal(signal.SIGCONT)
            with grpc.insecure_channel(hung.address) as channel:
                stub = pb_grpc.VerifierStub(channel)
                assert stub.GetStats(pb.StatsRequest(), timeout=30).live_sessions == 1  # the lost one, still held
        # The client closes while its retry of that close waits (5 s and more apart): it tries
        # once more before it closes, instead of leaving the session to the verifier's TTL.
        with grpc.insecure_channel(hung.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            assert stub.GetStats(pb.StatsRequest(), timeout=30).live_sessions == 0
        result = results[0]
        assert isinstance(result, GenerationResult), result
        assert result.token_ids == expected
        assert result.verifier_addresses == [hung.address, verifier_proc.address] and result.verifier_failovers == 1
        assert waited < 45, f"{waited:.0f} s to fail over"
        print(f"hung verifier: failed over, generation done {waited:.1f} s after the stop")
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        hung.kill()


@pytest.mark.slow
def test_generations_past_a_verifiers_max_sessions_queue_instead_of_evicting_each_other():
    """A verifier that admits 2 sessions and 5 concurrent generations: the client queues the
    other 3 until sessions end (ModelInfo.max_sessions), as vLLM's waiting queue, instead of
    opening them anyway, which evicts idle sessions to be re-prefilled (or, with every session
    mid-call, fails with RESOURCE_EXHAUSTED: the gateway's 503)."""
    small = start_service("verifier", ARGS + ["--max-sessions", "2"], threads=1)
    try:
        with SpeculativeClient(small.address) as client:
            assert client.verifier_info.max_sessions == 2
            expected = [client.generate(p, GREEDY, target_only=True).token_ids for p in PROMPTS[:5]]
            progress: collections.Counter = collections.Counter()
            results, threads = stream_concurrently(client, [(p, GREEDY) for p in PROMPTS[:5]], progress, gamma=0)
            peak = 0
            while any(t.is_alive() for t in threads):
                peak = max(peak, sum(client.verifiers.live_sessions().values()))
                time.sleep(0.005)
            stats = client.verifier.GetStats(pb.StatsRequest(), timeout=10)
        assert [getattr(r, "token_ids", r) for r in results] == expected
        assert stats.evictions == 0 and peak == 2, (stats.evictions, peak)
    finally:
        small.kill()


def test_a_verifier_full_of_other_clients_calls_queues_a_generation_instead_of_failing_it():
    """Another process holds a verifier's only session mid-call (a long prefill), so OpenSession
    answers RESOURCE_EXHAUSTED (no idle session to evict). That is the verifier full for now,
    not down: the generation waits until the call ends and then gets a session (the other
    one, idle, is evicted); with timeout_s shorter than the wait it fails with TimeoutError
    (the gateway's 503 upstream_full) saying so, instead of failing at once."""
    svc = start_service("verifier", ARGS + ["--max-sessions", "1"], threads=1)
    try:
        with SpeculativeClient(svc.address) as client, SpeculativeClient(svc.address, timeout_s=0.3) as impatient:
            expected = client.generate(PROMPTS[0], GREEDY, target_only=True).token_ids
            with grpc.insecure_channel(svc.address) as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
                stub = pb_grpc.VerifierStub(channel)
                other = stub.OpenSession(pb.OpenSessionRequest()).session_id  # our session (closed) is gone
                busy = pool.submit(stub.Verify, pb.VerifyRequest(
                    session_id=other, append_token_ids=[100 + i % 300 for i in range(1500)],
                    sampling=pb.SamplingParams(temperature=0.0)))
                time.sleep(0.3)  # the prefill (seconds on one thread) is in flight
                start = time.monotonic()
                with pytest.raises(TimeoutError, match="refused a session for 0.3 s .*call in flight"):
                    impatient.generate(PROMPTS[0], GREEDY, target_only=True)
                assert time.monotonic() - start >= 0.3 and not busy.done()
                result = client.generate(PROMPTS[0], GREEDY, target_only=True)
                assert busy.done() and busy.result().kv_length == 1500
                assert stub.GetStats(pb.StatsRequest()).evictions == 1
            assert result.token_ids == expected
    finally:
        svc.kill()


def test_generations_refused_by_a_shared_verifier_get_it_in_the_order_they_came():
    """Another process holds a verifier's only session mid-call, so it refuses ours
    (RESOURCE_EXHAUSTED). Four generations of one client, arriving 0.1 s apart, each polled
    on its own and took the session in whatever order they woke (a hunt: the first to come
    finished 5th of 6). They now wait in the client's line and finish in the order they came."""
    svc = start_service("verifier", ARGS + ["--max-sessions", "1"], threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        with SpeculativeClient(svc.address) as client:
            expected = [client.generate(p, params, target_only=True).token_ids for p in PROMPTS[:4]]
            with grpc.insecure_channel(svc.address) as channel, concurrent.futures.ThreadPoolExecutor(5) as pool:
                stub = pb_grpc.VerifierStub(channel)
                other = stub.OpenSession(pb.OpenSessionRequest()).session_id
                busy = pool.submit(stub.Verify, pb.VerifyRequest(
                    session_id=other, append_token_ids=[100 + i % 300 for i in range(1500)],
                    sampling=pb.SamplingParams(temperature=0.0)))
                time.sleep(0.3)  # the prefill is in flight: OpenSession is refused until it ends
                finished: list[int] = []

                def one(i: int) -> list[int]:
                    out = client.generate(PROMPTS[i], params, target_only=True).token_ids
                    finished.append(i)
                    return out

                runs = []
                for i in range(4):
                    runs.append(pool.submit(one, i))
                    time.sleep(0.1)
                outs = [r.result(timeout=120) for r in runs]
                assert not busy.exception()
        assert outs == expected
        assert finished == [0, 1, 2, 3]
    finally:
        svc.kill()


def test_separate_clients_past_a_verifiers_max_sessions_queue_instead_of_evicting_each_other():
    """Four separate clients (four gateways, say) and a verifier that admits 2 sessions: the
    third and fourth generations wait for a session to end. The verifier evicts only sessions
    idle for --evict-after-idle-s (2 s), and a generation between its rounds is idle for
    milliseconds; before, each open evicted a running generation, which re-opened (evicting
    another) and re-prefilled, over and over. The greedy output is the target's either way."""
    small = start_service("verifier", ARGS + ["--max-sessions", "2"], threads=1)
    try:
        with SpeculativeClient(small.address) as solo:
            expected = [solo.generate(p, GREEDY, target_only=True).token_ids for p in PROMPTS[:4]]
        clients = [SpeculativeClient(small.address) for _ in range(4)]
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda i: clients[i].generate(PROMPTS[i], GREEDY, target_only=True),
                                        range(4)))
            stats = clients[0].verifier.GetStats(pb.StatsRequest(), timeout=10)
        finally:
            for client in clients:
                client.close()
        assert [r.token_ids for r in results] == expected
        assert stats.evictions == 0 and sum(r.verifier_recoveries for r in results) == 0, \
            (stats.evictions, [r.verifier_recoveries for r in results])
    finally:
        small.kill()
