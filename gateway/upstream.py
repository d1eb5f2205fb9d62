"""The speculative client behind the gateway, and how the event loop drives it.

One `SpeculativeClient` (its channels, server pools and event loop) serves every request
of the process: each generation's rounds keep their state in local variables, and only
decode with the shared tokenizer, on the client's loop. Encoding runs on worker threads
through one lock here, because a fast tokenizer's Rust object may refuse concurrent calls
that touch its settings.

The client runs every generation's rounds on its own event loop (`grpc.aio`); each
request's generation is a task here that reads the client's `astream`, at most
`max_concurrent_requests` at once (more requests wait for a slot), and hands its chunks to
the handler through an asyncio queue: no thread per request, no thread wake-up per round.
Cancelling a `Generation` (the HTTP client went away) ends the generation in the client,
which closes both upstream sessions at once instead of leaving them to the TTL.

The upstream may be down when the gateway starts (compose restarts, a verifier still
loading): `connect_forever` keeps trying in the background, and /health answers 503 with
the last error until it succeeds. A request that arrives meanwhile waits for the connection
(`wait_ready`) up to `recovery_timeout_s`, the bound it would also wait for a verifier lost
mid-generation, then proceeds, or fails with a 503 that says what it waited for and how long.
While requests wait the next attempt comes within `_CONNECT_RETRY_S[0]`, not after the backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import anyio
import grpc

from client.output import TokenBytes
from client.pool import parse_addresses
from client.speculative import ClientClosed, IncompatibleModels, SpeculativeClient, StreamChunk
from gateway.protocol import APIError
from specdec.argtypes import DEFAULT_DECODE_STEPS
from specdec.errors import InvalidArgument
from specdec.proposals import ProposalFormat
from specdec.sampling import SamplingParams
from specdec_rpc import specdec_pb2 as pb

log = logging.getLogger("specdec.gateway")

_CONNECT_RETRY_S = (0.5, 10.0)  # backoff of the background connection attempts: first, longest
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class UpstreamConfig:
    verifier: str  # HOST:PORT, or a comma-separated pool
    drafter: str | None = None
    num_speculative_tokens: int | str = "auto"
    fanout: int = 0
    decode_steps: int = DEFAULT_DECODE_STEPS  # target-only steps a round without drafts may run
    proposal_format: ProposalFormat | None = None  # the client's default (ids when greedy, else dense float32)
    timeout_s: float = 60.0
    recovery_timeout_s: float = 10.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    max_concurrent_requests: int = 64

    def __post_init__(self) -> None:  # at start, not in the background connection's retries
        parse_addresses(self.verifier, "verifier")
        parse_addresses(self.drafter, "drafter")


class _TokenizerCopies:
    """Copies of the current client's tokenizer, one per encoding in progress (made on demand,
    up to MAX_IDLE kept for reuse; a new client's replace them). Thread-safe."""

    # A spike of 200 requests made ~40 copies (anyio's thread limit), ~5 MB each, kept for good.
    MAX_IDLE = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: object | None = None
        self._idle: list = []

    def take(self, client):
        with self._lock:
            if self._client is not client:
                self._client, self._idle = client, []
            if self._idle:
                return self._idle.pop()
        tokenizer = getattr(client, "tokenizer", None)
        return copy.deepcopy(tokenizer) if tokenizer is not None else None  # ~0.1 s, once per level of concurrency

    def give_back(self, client, tokenizer) -> None:
        with self._lock:
            if self._client is client and tokenizer is not None and len(self._idle) < self.MAX_IDLE:
                self._idle.append(tokenizer)


def _text_length(content: object) -> int:
    """Characters of a chat message's content: a string, or text parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


def upstream_error(exc: BaseException) -> APIError:
    """What an upstream failure means to the HTTP client: the verifier unreachable (or
    full past the queue's wait) is 503, a request the services refused is 400, anything else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        message = f"upstream {code.name}: {exc.details()}"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED):
            return APIError(503, message, type="service_unavailable", code="upstream_unavailable")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            # A sampling field the services refused ("sampling.allowed_token_ids: ...") is the request's
            # field of that name; their other fields (session, append ids) are none of the request's.
            field = (exc.details() or "").partition(":")[0]
            param = field.removeprefix("sampling.") if field.startswith("sampling.") else None
            return APIError(400, message, param=param if param and param.isidentifier() else None)
        return APIError(500, message, type="server_error", code="upstream_error")
    if isinstance(exc, IncompatibleModels):
        return APIError(503, str(exc), type="service_unavailable", code="upstream_incompatible")
    if isinstance(exc, ClientClosed):  # the client was replaced (a redeploy) or the gateway is stopping
        return APIError(503, str(exc), type="service_unavailable", code="upstream_unavailable")
    if isinstance(exc, TimeoutError):  # queued for a verifier session past timeout_s
        return APIError(503, str(exc), type="service_unavailable", code="upstream_full")
    if isinstance(exc, ConnectionError):  # NoServerAvailable: every verifier down, none due for a retry
        return APIError(503, str(exc), type="service_unavailable", code="upstream_unavailable")
    if isinstance(exc, InvalidArgument):  # a sampling field the client refused before any call
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


_END = object()


async def _acquire(slots: asyncio.Semaphore, wait_s: float) -> bool:
    """slots.acquire() within wait_s: whether it was taken. A permit taken just as the wait
    ends (or as the request is cancelled) is given back, never lost."""
    taking = asyncio.ensure_future(slots.acquire())

    def drop() -> None:
        taking.cancel()  # no effect if it was taken already: then the callback gives it back
        taking.add_done_callback(lambda t: slots.release() if not t.cancelled() and t.exception() is None else None)

    try:
        done, _ = await asyncio.wait({taking}, timeout=wait_s)
    except BaseException:
        drop()
        raise
    if not done:
        drop()
    return bool(done)


@dataclass(eq=False)
class Generation:
    """One request's generation: a task on the gateway's loop; its chunks arrive through `next()`."""

    on_stale: Callable[[IncompatibleModels], None] | None = None  # every verifier serves another model now
    running: bool = False  # holds a generation slot: vllm:num_requests_running, else _waiting
    scheduled: float | None = None  # perf_counter when it got its slot (vllm:request_queue_time_seconds)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _task: asyncio.Task | None = None

    async def run(self, client: SpeculativeClient, prompt_ids: list[int], params: SamplingParams,
                  gamma: int | str, fanout: int, slots: asyncio.Semaphore, slot_wait_s: float) -> None:
        """The task's body: waits for a slot (at most slot_wait_s, then 503 server_busy: a
        queue without a bound held a request 55 s behind one long generation), then relays
        the client's chunks."""
        try:
            if not await _acquire(slots, slot_wait_s):
                raise APIError(503, f"every one of the gateway's generation slots (--max-concurrent-requests) was "
                                    f"busy for {slot_wait_s:g} s; retry later", type="service_unavailable",
                               code="server_busy")
            self.running, self.scheduled = True, time.perf_counter()
            try:
                async for chunk in client.astream(prompt_ids, params, num_speculative_tokens=gamma, fanout=fanout):
                    self._queue.put_nowait(chunk)
            finally:
                self.running = False
                slots.release()
        except Exception as exc:  # noqa: BLE001 - handed to the request's handler
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_END)

    async def next(self) -> StreamChunk | None:
        """The next round's chunk; None after the last one. Raises the generation's error."""
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # later calls see the end too
            return None
        if isinstance(item, BaseException):
            if isinstance(item, IncompatibleModels) and self.on_stale is not None:
                self.on_stale(item)
            raise upstream_error(item)
        return item

    def cancel(self) -> None:
        """End the generation; the client closes its upstream sessions."""
        if self._task is not None:
            self._task.cancel()


class Upstream:
    def __init__(self, config: UpstreamConfig,
                 client_factory: Callable[[UpstreamConfig], SpeculativeClient] | None = None) -> None:
        self.config = config
        self.client: SpeculativeClient | None = None
        self.last_error: str | None = "not connected yet"
        # The last attempt reached the services and found a pair that cannot work together
        # (tokenizers, vocabularies): requests are answered at once, not after waiting for a
        # connection that retrying alone will not bring (a redeploy may; retries go on).
        self.incompatible = False
        self._factory = client_factory or _make_client
        self._tokenizers = _TokenizerCopies()
        self._chars_per_token: tuple[SpeculativeClient, int] | None = None  # (client, longest vocabulary entry)
        self._token_bytes: TokenBytes | None = None  # of the connected client's tokenizer
        self._slots: asyncio.Semaphore | None = None  # max_concurrent_requests; made on the loop
        self._generations: set[Generation] = set()
        # Not bound to a loop until first awaited (Python >= 3.10): the app may build this object
        # before uvicorn starts its loop.
        self._ready = asyncio.Event()  # set once `client` is
        self._attempt = asyncio.Event()  # set (and replaced) after each failed connection attempt
        self._waiter_arrived = asyncio.Event()  # cuts the connection loop's backoff short
        self._waiting = 0  # requests in wait_ready now
        self._reconnect: asyncio.Future | None = None  # connect_forever after a redeploy (_stale)
        self._closing: asyncio.Future | None = None  # the replaced client's close() (_stale)

    # ---- connection ---------------------------------------------------------------------------

    async def connect_forever(self) -> None:
        """Try to build the client until it works (backoff 0.5 s doubling to 10 s, but at most
        0.5 s while a request waits for it)."""
        delay = _CONNECT_RETRY_S[0]
        if self.client is not None:
            self._ready.set()
        while self.client is None:
            try:
                self.client = await anyio.to_thread.run_sync(self._factory, self.config)
            except Exception as exc:  # noqa: BLE001 - logged, reported by /health, retried
                detail = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError)
                          else f"{type(exc).__name__}: {exc}")
                if self.last_error != detail:
                    log.log(logging.ERROR if isinstance(exc, IncompatibleModels) else logging.WARNING,
                            "upstream not ready (verifier=%s drafter=%s): %s; retrying", self.config.verifier,
                            self.config.drafter, detail)
                self.last_error, self.incompatible = detail, isinstance(exc, IncompatibleModels)
                attempt, self._attempt = self._attempt, asyncio.Event()
                attempt.set()  # waiting requests look at the outcome
                await self._pause(delay)
                delay = min(2 * delay, _CONNECT_RETRY_S[1])
                continue
            self.last_error, self.incompatible = None, False
            self._ready.set()
            info = self.client.verifier_info
            log.info("upstream ready verifier=%s model=%s max_context=%d drafter=%s", self.config.verifier,
                     info.model, info.max_context, self.config.drafter)

    async def _pause(self, delay: float) -> None:
        """Sleep until the next connection attempt: `delay`, or the shortest step when a request
        waits now or arrives meanwhile (never less, so a burst of requests is not a burst of attempts)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._waiter_arrived.clear()
        with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError only from 3.11
            await asyncio.wait_for(self._waiter_arrived.wait(), _CONNECT_RETRY_S[0] if self._waiting else delay)
        await asyncio.sleep(max(0.0, start + _CONNECT_RETRY_S[0] - loop.time()))

    async def wait_ready(self, timeout_s: float | None = None) -> SpeculativeClient:
        """The client, once connected: a request that arrives while the gateway is still
        connecting waits for it up to timeout_s (default: recovery_timeout_s); then 503."""
        if self.client is not None:
            return self.client
        bound = self.config.recovery_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        self._waiting += 1
        self._waiter_arrived.set()
        try:
            while self.client is None:
                if self.incompatible:
                    raise self._incompatible_error()
                if loop.time() >= deadline:
                    raise APIError(503, f"the gateway waited {bound:g} s for its connection to the upstream verifier "
                                        f"({self.config.verifier}) and it is still not reachable: {self.last_error}",
                                   type="service_unavailable", code="upstream_unavailable")
                waits = {asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self._attempt.wait())}
                try:
                    await asyncio.wait(waits, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when the request is cancelled (its client left)
                    for task in waits:
                        task.cancel()
        finally:
            self._waiting -= 1
        return self.require()

    def _incompatible_error(self) -> APIError:
        return APIError(503, f"the upstream services cannot serve together (verifier {self.config.verifier}, drafter "
                             f"{self.config.drafter}): {self.last_error}; the gateway keeps retrying, for a redeploy",
                        type="service_unavailable", code="upstream_incompatible")

    def require(self) -> SpeculativeClient:
        if self.client is None:
            raise APIError(503, f"the upstream verifier is not reachable yet: {self.last_error}",
                           type="service_unavailable", code="upstream_unavailable")
        return self.client

    async def health(self) -> tuple[bool, dict]:
        """(whether some verifier answers now, per-server detail). Drafters are reported but
        do not decide: without them generations continue target-only."""
        if self.client is None:
            return False, {"status": "incompatible" if self.incompatible else "connecting", "error": self.last_error}
        client = self.client

        def probe_all() -> dict:
            # every server at once: a hung verifier and a hung drafter cost one timeout, not two
            pools = {"verifiers": client.verifiers, **({"drafters": client.drafters} if client.drafters else {})}
            calls = {name: [(s.address, s.stub.GetModelInfo.future(pb.ModelInfoRequest(), timeout=HEALTH_TIMEOUT_S))
                            for s in pool.servers] for name, pool in pools.items()}
            detail: dict = {}
            for name, pending in calls.items():
                detail[name] = {}
                for server, (address, call) in zip(pools[name].servers, pending):
                    try:
                        call.result()
                        # A member left out of its pool (it came back serving another model) answers,
                        # but no generation goes to it: it is no capacity.
                        detail[name][address] = "up" if server.disabled is None else "left out"
                    except grpc.RpcError as exc:
                        detail[name][address] = exc.code().name
            return detail

        detail = await anyio.to_thread.run_sync(probe_all)
        ok = "up" in detail["verifiers"].values()
        degraded = "drafters" in detail and "up" not in detail["drafters"].values()
        detail["status"] = "unavailable" if not ok else "degraded" if degraded else "ok"
        return ok, detail

    # ---- requests -----------------------------------------------------------------------------

    async def encode(self, prompt: str | Sequence[int] | None = None, messages: list[dict] | None = None,
                     template_options: dict | None = None, add_special_tokens: bool = True) -> list[int]:
        client = self.require()
        param = "messages" if messages is not None else "prompt"

        def encode() -> list[int]:
            self._refuse_what_cannot_fit(client, param, prompt, messages)
            # A copy of the tokenizer per concurrent encoding: one shared by threads can fail
            # ("Already borrowed"), and one long prompt must not hold up every other request.
            tokenizer = self._tokenizers.take(client)
            try:
                if messages is not None:
                    return client.encode_chat(messages, tokenizer=tokenizer, **(template_options or {}))
                return client.encode_prompt(prompt, tokenizer=tokenizer, add_special_tokens=add_special_tokens)
            finally:
                self._tokenizers.give_back(client, tokenizer)

        try:
            return await anyio.to_thread.run_sync(encode)
        except APIError:
            raise
        except Exception as exc:  # a chat template that refuses the roles' order, ids outside the vocabulary
            raise APIError(400, f"{param} could not be tokenized: {exc}", param=param) from exc

    def _refuse_what_cannot_fit(self, client: SpeculativeClient, param: str, prompt, messages) -> None:
        """400 for text that cannot fit the context whatever it says, before tokenizing it: no
        token covers more characters than the vocabulary's longest entry, so a text longer than
        max_context of those has more than max_context tokens. Tokenizing a 20 MB prompt took
        17 s, with every other request's tokenization waiting behind it."""
        if self._chars_per_token is None or self._chars_per_token[0] is not client:
            vocab = getattr(getattr(client, "tokenizer", None), "get_vocab", None)
            self._chars_per_token = (client, max(map(len, vocab())) if vocab is not None else 0)
        per_token, max_context = self._chars_per_token[1], client.verifier_info.max_context
        if isinstance(prompt, str):
            chars = len(prompt)
        elif messages is not None:
            chars = sum(_text_length(m.get("content")) for m in messages if isinstance(m, dict))
        else:
            return
        if per_token and chars > max_context * per_token:
            raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, your {param} "
                                f"{'have' if param == 'messages' else 'has'} more: {chars} characters, and no token "
                                f"holds more than {per_token}.",
                           param=param, code="context_length_exceeded")

    def decode_token(self, token_id: int) -> str:
        return self.require().tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (client.output.TokenBytes), for the client now connected."""
        tokenizer = self.require().tokenizer
        if self._token_bytes is None or self._token_bytes.tokenizer is not tokenizer:
            self._token_bytes = TokenBytes(tokenizer)
        return self._token_bytes(token_id)

    def start(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Start a generation (it waits for a slot); read it with `next()`, `cancel()` when done."""
        client = self.require()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrent_requests)
        gen = Generation(on_stale=lambda exc: self._stale(client, exc))
        self._generations.add(gen)
        # A seeded request reproduces under "auto" too: the client derives its γ schedule from its
        # own rounds only (specdec/adaptive.py, AdaptiveGamma.deterministic).
        gamma = self.config.num_speculative_tokens if client.drafters is not None else 0  # no drafter: target-only
        gen._task = asyncio.ensure_future(gen.run(client, prompt_ids, params, gamma, self.config.fanout, self._slots,
                                                  self.config.timeout_s))
        gen._task.add_done_callback(lambda _: self._generations.discard(gen))
        return gen

    def running(self) -> int:
        """Generations holding a slot."""
        return sum(g.running for g in self._generations)

    def waiting(self) -> int:
        """Generations waiting for a slot."""
        return len(self._generations) - self.running()

    def stop_connecting(self) -> None:
        """On the event loop, at shutdown: no reconnection after a redeploy from here."""
        if self._reconnect is not None:
            self._reconnect.cancel()

    def _stale(self, client: SpeculativeClient, exc: IncompatibleModels) -> None:
        """Every verifier of `client`'s pool came back serving another model (a redeploy): build
        a new client for what they serve now, so the gateway follows the redeploy (/v1/models
        included) instead of answering 503 until it is restarted. On the event loop."""
        if self.client is not client:
            return  # another generation saw it first
        log.warning("every verifier serves another model now (%s); reconnecting", exc)
        self.client, self.last_error = None, f"reconnecting: {exc}"
        self._ready.clear()
        self._reconnect = asyncio.ensure_future(self.connect_forever())  # held: a task only weakly referenced may vanish
        self._closing = asyncio.ensure_future(asyncio.to_thread(client.close))  # its generations fail anyway

    async def close(self) -> None:
        """End every generation (closing its sessions), then the client's channels."""
        tasks = [gen._task for gen in self._generations if gen._task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.client is not None:
            await asyncio.to_thread(self.client.close)
        if self._closing is not None:  # a client replaced after a redeploy may still be closing
            await asyncio.gather(self._closing, return_exceptions=True)


def _make_client(config: UpstreamConfig) -> SpeculativeClient:
    return SpeculativeClient(config.verifier, drafter=config.drafter, timeout_s=config.timeout_s,
                             num_speculative_tokens=config.num_speculative_tokens, tls_ca=config.tls_ca,
                             tls_cert=config.tls_cert, tls_key=config.tls_key, auth_token=config.auth_token,
                             recovery_timeout_s=config.recovery_timeout_s, fanout=config.fanout,
                             proposal_format=config.proposal_format, decode_steps=config.decode_steps,
                             batch_verify=True)  # one VerifyBatch per step for all its generations
