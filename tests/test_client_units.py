"""Pure units of the client's per-round bookkeeping, no services: the common prefix that
decides how far each side truncates, and the hand-over of chunks to another event loop."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from client.speculative import _ClientLoop, _lcp, _Mailbox


def _lcp_reference(cached: list[int], committed: list[int], limit: int) -> int:
    n = min(len(cached), len(committed), limit)
    return next((i for i in range(n) if cached[i] != committed[i]), n)


def test_common_prefix_matches_an_element_by_element_scan():
    """Sequences that agree on a prefix and then differ anywhere (or not at all), of every
    relative length, under every limit: the C-level comparison with its bisection gives the
    element-by-element answer."""
    rng = random.Random(0)
    differ = 0
    for _ in range(20000):
        base = [rng.randrange(3) for _ in range(rng.randrange(40))]
        cached = base[:rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        committed = base if rng.random() < 0.5 else base[:rng.randint(0, len(base))]
        limit = rng.randrange(50)
        expected = _lcp_reference(cached, committed, limit)
        differ += expected < min(len(cached), len(committed), limit)
        assert _lcp(cached, committed, limit) == expected, (cached, committed, limit)
    assert differ > 2000  # the bisection path ran, not only the agreeing fast path


def test_mailbox_hands_every_item_over_in_order_with_one_wakeup_per_burst():
    """Items put from another thread reach each reader's queue in the order they were put, none
    lost; a burst put while the readers' loop is busy costs one wake-up, not one per item."""
    readers: dict[int, asyncio.Queue] = {}
    got: dict[int, list[int]] = {i: [] for i in range(8)}
    wakeups = 0
    burst_done = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for i in range(8):
            readers[i] = asyncio.Queue()
        mailbox = _Mailbox(loop)
        deliver = mailbox._deliver

        def counted() -> None:
            nonlocal wakeups
            wakeups += 1
            deliver()

        mailbox._deliver = counted

        def producer() -> None:
            for n in range(100):  # one burst of 800 items while the loop waits on burst_done
                for i in range(8):
                    mailbox.put(readers[i], n)
            burst_done.set()
            for n in range(100, 110):  # then items one at a time
                for i in range(8):
                    mailbox.put(readers[i], n)

        thread = threading.Thread(target=producer)
        thread.start()
        await asyncio.to_thread(burst_done.wait)
        for i in range(8):
            while len(got[i]) < 110:
                got[i].append(await asyncio.wait_for(readers[i].get(), 10))
        thread.join()

    asyncio.run(main())
    assert all(got[i] == list(range(110)) for i in range(8))
    assert wakeups <= 1 + 80  # the 800-item burst took one wake-up (at most one per later item)


def test_mailbox_of_a_closed_loop_drops_items_instead_of_raising():
    loop = asyncio.new_event_loop()
    mailbox = _Mailbox(loop)
    loop.close()
    items: asyncio.Queue = asyncio.Queue()
    mailbox.put(items, 1)  # nobody reads: dropped
    mailbox.put(items, 2)
    assert not mailbox._items


def test_a_stream_that_breaks_internal_after_answering_fails_its_rounds_as_unavailable():
    """A VerifyStream ending INTERNAL mid-way is its transport breaking (a write racing a server
    that shuts down), never a round's own error, which comes in its reply entry. Its unanswered
    rounds fail UNAVAILABLE, which the round loop recovers from on the pool; INTERNAL failed the
    generation (seen once in 25 verifier SIGTERMs behind the gateway)."""
    import grpc

    from client.batching import BatchEntryError, VerifyBatcher, _Pending
    from specdec_rpc import specdec_pb2 as pb

    async def run() -> BaseException:
        batcher = VerifyBatcher(stub=None, name="v1")
        pending = _Pending(pb.VerifyRequest(), 0.0, asyncio.get_running_loop().create_future())
        batcher._stream_ended([[pending]], BatchEntryError(grpc.StatusCode.INTERNAL, "Internal error from Core"),
                              answered=True)
        return pending.future.exception()

    exc = asyncio.run(run())
    assert exc.code() == grpc.StatusCode.UNAVAILABLE and "INTERNAL: Internal error from Core" in exc.details()


def test_rounds_of_several_decode_steps_travel_apart_from_one_step_rounds():
    """A step message is answered when its last round is: a one-step round batched with another
    generation's 4-step round waited 3 steps more. They go in messages of their own."""
    from client.batching import VerifyBatcher
    from specdec_rpc import specdec_pb2 as pb

    sent: list[list[int]] = []

    async def run() -> None:
        batcher = VerifyBatcher(stub=None, name="v1")

        def send(batch) -> None:  # what would go out as one message; answered at once
            sent.append(sorted(p.request.decode_steps for p in batch))
            for p in batch:
                p.future.set_result(pb.VerifyResponse())

        batcher._send = send
        rounds = [pb.VerifyRequest(session_id=str(i), decode_steps=steps) for i, steps in enumerate((0, 4, 0, 4, 4))]
        await asyncio.gather(*(batcher.verify(r, timeout=10, expected=len(rounds)) for r in rounds))

    asyncio.run(run())
    assert sorted(sent) == [[0, 0], [4, 4, 4]], sent  # one step's rounds: two messages, by kind


def test_the_batchers_linger_follows_a_steps_latency_not_a_messages_of_several_steps():
    """The linger (how long a message waits for the rest of the client's rounds) is a tenth of a
    step's latency: a message of 4-step rounds that took 12 ms is 3 ms a step, as a one-step
    message of 3 ms is; counted whole it lingered 4x as long."""
    from client.batching import LINGER_SHARE, VerifyBatcher, _Pending
    from specdec_rpc import specdec_pb2 as pb

    def latency_after(steps: int, seconds: float) -> float:
        batcher = VerifyBatcher(stub=None, name="v1")
        batch = [_Pending(pb.VerifyRequest(decode_steps=steps), 0.0, None) for _ in range(3)]
        for _ in range(60):
            batcher._returned(seconds, batch)
        return batcher._latency_s

    one_step = latency_after(0, 0.003)
    assert one_step == pytest.approx(0.003, rel=1e-3)  # the decayed mean, converged
    assert latency_after(4, 0.012) == pytest.approx(one_step)
    assert LINGER_SHARE * latency_after(4, 0.012) == pytest.approx(0.0003, rel=1e-3)


def test_a_closed_client_loop_drops_late_grpc_events_instead_of_raising():
    """gRPC's aio layer dispatches every loop's completion events from whichever bound loop
    polls: a closed client's cancelled VerifyStream could still get its last events, and the
    other client's loop printed "RuntimeError: Event loop is closed" (seen in 1 of 4 runs of
    8 clients that each abandoned a stream). A closed client loop drops them; an open one runs
    them, and a plain loop still raises."""
    loop = _ClientLoop()
    ran: list[int] = []
    loop.call_soon_threadsafe(ran.append, 1)
    loop.run_until_complete(asyncio.sleep(0))
    assert ran == [1]
    loop.close()
    assert loop.call_soon_threadsafe(ran.append, 2) is None and ran == [1]
    plain = asyncio.new_event_loop()
    plain.close()
    with pytest.raises(RuntimeError, match="closed"):
        plain.call_soon_threadsafe(ran.append, 3)


def test_a_fixed_gammas_rounds_without_a_drafter_run_several_decode_steps():
    """A fixed γ's rounds without drafts ran one token a call: right for its last rounds and
    while its drafter prefills, but after the drafter was lost it ran 1,848 rounds for 1,900
    tokens. Rounds that no drafter answered now take up to decode_steps tokens."""
    from types import SimpleNamespace

    from client.speculative import SpeculativeClient

    client = SimpleNamespace(decode_steps=4)

    def gen(**changes) -> SimpleNamespace:
        base = dict(result=SimpleNamespace(num_rounds=5, token_ids=[0] * 10),
                    drafter=SimpleNamespace(prefill=None), gamma_max=4, controller=None,
                    output=SimpleNamespace(params=SimpleNamespace(max_tokens=100)))
        return SimpleNamespace(**{**base, **changes})

    steps = SpeculativeClient._decode_steps
    assert steps(client, gen()) == 1  # a fixed γ waiting for its drafter, or its last rounds
    assert steps(client, gen(), drafter_lost=True) == 4
    assert steps(client, gen(output=SimpleNamespace(params=SimpleNamespace(max_tokens=12))), drafter_lost=True) == 2
    assert steps(client, gen(result=SimpleNamespace(num_rounds=0, token_ids=[])), drafter_lost=True) == 1  # the TTFT
    assert steps(client, gen(gamma_max=0)) == 4  # target-only
