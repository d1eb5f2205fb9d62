"""SpeculativeClient: runs draft / verify rounds against the two services.

Every generation of a client runs on the client's one event loop (a thread it owns), over
`grpc.aio` channels: a round is a coroutine that awaits its Draft and its Verify, so
dozens of concurrent generations cost no thread each and no thread wake-up per round (a
quarter to a third of a threaded client's CPU per round). `generate` and `stream` are the
blocking API, for any thread; `agenerate` and `astream` serve callers on another event
loop (the gateway, `bench serve`). Chunks cross to the caller through a queue; the
rounds never wait for it.

KV bookkeeping lives here. The client remembers which tokens each service's cache
holds (`_Link.kv`); each round it asks each service to keep the
longest prefix of that which still agrees with the committed sequence (`truncate_to`)
and to append the committed tokens after it. After a rejection the drafter cache holds
drafts past the rejection point: those are dropped by the next call's truncation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import operator
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Iterator, Mapping, Sequence

import grpc
from jinja2 import TemplateError

from client.batching import VerifyBatcher
from client.output import GenerationResult, OutputProcessor, StreamChunk
from client.pool import Server, ServerPool, parse_addresses
from specdec.adaptive import AdaptiveGamma, ServingCosts
from specdec.argtypes import DEFAULT_DECODE_STEPS, MAX_DECODE_STEPS
from specdec.errors import InvalidArgument, invalid_text
from specdec.models import ModelSpec, load_tokenizer, tokenizer_fingerprint
from specdec.proposals import DENSE, IDS_ONLY, ProposalFormat
from specdec.sampling import REJECTION, SamplingParams, check_min_tokens
from specdec.serving import ModelInfo
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import (
    CHANNEL_OPTIONS,
    load_from_pb,
    model_info_from_pb,
    proposal_format_to_pb,
    sampling_to_pb,
)
from specdec_rpc.ops import RECONNECT_BACKOFF_MAX_S, TLSFiles, bearer_metadata, open_aio_channel, open_channel

__all__ = ["ClientClosed", "GenerationResult", "IncompatibleModels", "NoServerAvailable", "SpeculativeClient",
           "StreamChunk", "check_compatible"]

log = logging.getLogger(__name__)


AUTO = "auto"  # num_speculative_tokens: adaptive γ per round, 0 included (the default)
AUTO_GAMMA_MAX = 8
# Adaptive γ drafts nothing from this many sessions on a verifier whose GPU the drafter shares:
# two processes time-slice one GPU, as two engines oversubscribe one host's cores (the verifier's
# CPU default of --speculative-disable-by-batch-size; ServingCosts.shared_gpu_cap).
SHARED_GPU_DISABLE_BY_BATCH_SIZE = 2
# A drafter this many tokens behind the committed sequence (its first prefill, a failover)
# catches up off the critical path, during target-only rounds, instead of inside a Draft.
ASYNC_CATCHUP_TOKENS = 32
_END = object()  # a generation's last item on its way to the caller
_CLOSE_WAIT_S = 10.0  # how long a caller that stops reading waits for the generation's sessions to close
_CLOSE_MIN_S = 0.5  # the shortest deadline a CloseSession gets


class _ClientLoop(asyncio.SelectorEventLoop):
    """The client's own event loop. gRPC's aio layer has one completion queue per process,
    whose events any bound loop may dispatch: the last events of a call cancelled at close()
    (a VerifyStream's pending read and status) can reach this loop after it has closed, and
    asyncio then prints "RuntimeError: Event loop is closed" from another client's loop. No
    one awaits those events; they are dropped."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise


class NoServerAvailable(ConnectionError):
    """Every server of a pool failed its last try and none is due for another within the wait."""


class IncompatibleModels(ValueError):
    """The drafter and verifier (or the client's tokenizer) do not share a vocabulary."""


class ClientClosed(RuntimeError):
    """The client was closed before or while the generation ran: its output is incomplete."""


def _lcp(cached: Sequence[int], committed: Sequence[int], limit: int) -> int:
    """Length of the common prefix of the cache and the committed sequence, at most `limit`."""
    n = min(len(cached), len(committed), limit)
    if cached[:n] == committed[:n]:  # the usual case, compared in C: a round costs O(1) Python steps
        return n
    lo, hi = 0, n  # cached[:lo] agrees, cached[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cached[:mid] == committed[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SpeculativeClient:
    """Speculative decoding over a drafter and a verifier service, or pools of each.

    >>> client = SpeculativeClient("127.0.0.1:50052", drafter="127.0.0.1:50051")
    >>> client.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8)).text
    >>> pools = SpeculativeClient(["10.0.0.5:50052", "10.0.0.6:50052"], drafter="10.0.0.7:50051,10.0.0.8:50051")
    """

    def __init__(
        self,
        verifier: str | Sequence[str],
        drafter: str | Sequence[str] | None = None,
        *,
        tokenizer=None,
        timeout_s: float = 60.0,
        num_speculative_tokens: int | str = AUTO,
        proposal_format: ProposalFormat | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        auth_token: str | None = None,
        recovery_timeout_s: float = 60.0,
        fanout: int = 0,
        batch_verify: bool = False,
        decode_steps: int = DEFAULT_DECODE_STEPS,
    ) -> None:
        """verifier, drafter: HOST:PORT, or a pool of several (a sequence, or one
        comma-separated string). Each generation keeps one verifier and one drafter session,
        opened on the server of the pool with the fewest live sessions of this client; when
        that server fails, the session moves to another one and is re-prefilled. Every server
        that answers now must fit the others (else IncompatibleModels); one that does not
        answer is tried again later, as long as one server of its pool answers now.
        tls_*: PEM paths (any of them turns TLS on; cert + key for mutual TLS);
        auth_token: sent as `authorization: Bearer` on every call. recovery_timeout_s: how
        long a generation keeps retrying a restarting verifier before it fails. fanout > 0
        turns on the drafter's speculation cache: while the verifier scores a round, the
        drafter pre-drafts the next one for its top-`fanout` bonus candidates.
        num_speculative_tokens: γ, or "auto" (default): γ in [0, 8] per round, chosen for
        goodput from the load the services report (specdec/adaptive.py). batch_verify: the
        rounds of this client's concurrent generations on one verifier travel together, one
        VerifyBatch call per step (client/batching.py; for clients that carry many
        generations: the gateway, `bench`); output is the same as with unary calls.
        decode_steps: a round that sends no drafts, after a generation's first, may run up to
        this many target-only steps on the verifier (VerifyRequest.decode_steps) and answers
        them at once: one call per that many tokens where nothing is speculated (target-only
        generations, and adaptive γ while it chooses 0); 1 turns it off. Tokens are the same
        (greedy; seeded target-only; a seeded adaptive γ schedule counts rounds, so it differs
        between settings, still the same for one setting under any load); they stream in
        groups of up to this many."""
        for name, value in (("timeout_s", timeout_s), ("recovery_timeout_s", recovery_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.timeout_s = timeout_s
        self.num_speculative_tokens = _check_gamma(num_speculative_tokens)
        self.proposal_format = proposal_format
        self.recovery_timeout_s = recovery_timeout_s
        self.fanout = _check_fanout(fanout)  # speculation cache: bonus candidates the drafter pre-drafts per round
        self.decode_steps = _check_decode_steps(decode_steps)
        tls = TLSFiles(cert=tls_cert, key=tls_key, ca=tls_ca)
        self._channels: list[grpc.Channel] = []  # blocking, for callers' own calls (health probes, GetStats)
        self._aio_channels: list[grpc.aio.Channel] = []
        self._tasks: set[asyncio.Task] = set()  # background calls: drafter CloseSession, a late drafter's probe
        self._closing = asyncio.Event()  # set on the loop by close(): retried CloseSessions make their last try
        self._pumps: set[asyncio.Task] = set()  # running generations: close() cancels them
        # astream's readers, per event loop: chunks reach each loop in one wake-up per batch
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._closed = False
        self._stream_metadata = bearer_metadata(auth_token)
        self._costs: dict[str, ServingCosts] = {}  # per verifier address: its load model
        self._costs_lock = threading.Lock()
        self._batchers: dict[str, VerifyBatcher] | None = {} if batch_verify else None  # per verifier address
        self._loop = _ClientLoop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specdec-client", daemon=True)
        self._thread.start()

        def pool(role: str, addresses: list[str], stub_class) -> ServerPool:
            servers = []
            for address in addresses:
                self._channels.append(open_channel(address, tls=tls, auth_token=auth_token, options=CHANNEL_OPTIONS))
                servers.append(Server(address, stub_class(self._channels[-1])))
            return ServerPool(role, servers)

        async def connect() -> None:  # aio channels belong to the loop they are made on
            for servers, stub_class in ((self.verifiers.servers, pb_grpc.VerifierStub),
                                        (self.drafters.servers if self.drafters else [], pb_grpc.DrafterStub)):
                for server in servers:
                    self._aio_channels.append(open_aio_channel(server.address, tls=tls, auth_token=auth_token,
                                                               options=CHANNEL_OPTIONS))
                    server.astub = stub_class(self._aio_channels[-1])
            await self._join_pools()

        try:
            self.verifiers = pool("verifier", parse_addresses(verifier, "verifier"), pb_grpc.VerifierStub)
            drafters = parse_addresses(drafter, "drafter")
            self.drafters = pool("drafter", drafters, pb_grpc.DrafterStub) if drafters else None
            self._on_loop(connect())
            self.tokenizer = tokenizer or load_tokenizer(ModelSpec(model=self.verifier_info.tokenizer_source))
            if tokenizer_fingerprint(self.tokenizer) != self.verifier_info.tokenizer_fingerprint:
                raise IncompatibleModels(
                    f"the client's tokenizer differs from the verifier's ({self.verifier_info.model}); "
                    "pass the verifier's tokenizer"
                )
            gamma = self.num_speculative_tokens
            if gamma != AUTO and self.drafter_info is not None and (capped := self.effective_gamma(gamma)) < gamma:
                log.warning("num_speculative_tokens %d is past the services' max_draft_tokens (drafter %d, verifier "
                            "%d): rounds draft at most %d", gamma, self.drafter_info.max_draft_tokens,
                            self.verifier_info.max_draft_tokens, capped)
        except BaseException:
            self.close()
            raise

    def _on_loop(self, coro):
        """Run `coro` on the client's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _background(self, make: Callable[[], object]) -> None:
        """Run the coroutine `make()` as a task on the client's loop, from any thread."""
        if threading.current_thread() is self._thread:
            self._held(make())
        else:
            self._loop.call_soon_threadsafe(lambda: self._held(make()))

    def _held(self, coro) -> asyncio.Task:
        """`coro` as a task on the client's loop (from the loop's thread), held in `_tasks` until
        done: a task only weakly referenced may vanish, and close() waits for these."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _join_pools(self) -> None:
        """Ask every server for its model at once; set verifier_info / drafter_info: the first
        answering server's, with the pool's smallest limits (max_context, max_draft_tokens)."""
        verifiers = await self._probe(self.verifiers, _VERIFIER_LOST)
        ref = verifiers[0][1]
        for _, info in verifiers[1:]:
            _check_same_target(info, ref)
        self.verifier_info = _smallest_limits(ref, [info for _, info in verifiers])
        for server, info in verifiers:
            self.verifiers.succeeded(server, info)
        self.drafter_info: ModelInfo | None = None
        if self.drafters is not None:
            # No drafter up yet is not fatal: generations run target-only (as when every drafter
            # is lost mid-run) and `effective_gamma` lets one join as soon as it answers.
            drafters = await self._probe(self.drafters, _DRAFTER_LOST, required=False)
            for server, info in drafters:
                check_compatible(info, self.verifier_info)
            if drafters:
                self.drafter_info = _smallest_limits(drafters[0][1], [info for _, info in drafters])
            else:
                log.warning("no drafter of %s answers yet: generations run target-only until one does",
                            ", ".join(s.address for s in self.drafters.servers))
            for server, info in drafters:
                self.drafters.succeeded(server, info)

    def _late_drafter(self) -> None:
        """No drafter had answered: ask one that is due for a retry (the pool's backoff: at most
        one call per backoff period while all are down), off the caller's path: the generation
        that asks runs target-only, and the first drafter that answers and fits sets drafter_info
        for the ones after it."""
        server = self.drafters.pick()
        if server is not None and not self._closed:
            self._background(lambda: self._drafter_answered(server))

    async def _drafter_answered(self, server: Server) -> None:
        """_late_drafter's question and its answer (on the client's loop)."""
        try:
            info = await self._reprobe(self.drafters, server, lambda i: check_compatible(i, self.verifier_info))
        finally:
            self.drafters.release(server)
        if info is not None and self.drafter_info is None:
            self.drafter_info = info
            log.info("speculation starts with drafter %s", server.address)

    async def _probe(self, pool: ServerPool, lost: frozenset, required: bool = True) -> list[tuple[Server, ModelInfo]]:
        """(server, its ModelInfo) of the servers that answer GetModelInfo, in pool order; the
        others are marked down (tried again when a session needs one). Raises NoServerAvailable
        if none answers (unless not `required`), or any error that is not a lost server's."""
        calls = [(s, asyncio.ensure_future(s.astub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeout_s)))
                 for s in pool.servers]
        await asyncio.wait([call for _, call in calls])
        answered, errors = [], []
        for server, call in calls:
            try:
                answered.append((server, model_info_from_pb(call.result())))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a server of the other role (swapped addresses)
                    other = "drafter" if pool.role == "verifier" else "verifier"
                    raise IncompatibleModels(
                        f"{server.address} does not serve the {pool.role} API ({exc.details()}); is it a {other}? "
                        f"check the {pool.role} address") from exc
                if exc.code() not in lost:
                    raise
                log.warning("%s %s unavailable at start code=%s details=%r; will retry it", pool.role,
                            server.address, exc.code().name, exc.details())
                pool.failed(server)
                errors.append(exc)
        if not answered and required:
            first = errors[0]
            raise NoServerAvailable(
                f"no {pool.role} of {', '.join(s.address for s in pool.servers)} answered at start; "
                f"the first error: {first.code().name}: {first.details()}") from first
        return answered

    @property
    def verifier(self) -> pb_grpc.VerifierStub:
        """The first listed verifier (generations use the whole pool, `verifiers`)."""
        return self.verifiers.servers[0].stub

    @property
    def drafter(self) -> pb_grpc.DrafterStub | None:
        """The first listed drafter, or None without drafters (generations use `drafters`)."""
        return self.drafters.servers[0].stub if self.drafters is not None else None

    async def _verify(self, server: Server, request: pb.VerifyRequest, timeout: float) -> pb.VerifyResponse:
        """One round on `server`: unary, or batched with this client's other generations."""
        if self._batchers is None:
            return await server.astub.Verify(request, timeout=timeout)
        batcher = self._batchers.get(server.address)
        if batcher is None:
            batcher = VerifyBatcher(server.astub, server.address, self._stream_metadata)
            self._batchers[server.address] = batcher
        return await batcher.verify(request, timeout, expected=self.costs(server.address).local_running)

    def close(self) -> None:
        """Close every session this client holds (also those of generations still open, e.g.
        a `stream` not iterated to its end), then the channels and the client's loop."""
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("SpeculativeClient.close() was called on the client's own event loop")
        self._closed = True
        try:
            self._on_loop(self._aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            for ch in self._channels:
                ch.close()

    async def _aclose(self) -> None:
        pumps = list(self._pumps)
        for task in pumps:  # each ends its generation: both sessions closed
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for batcher in (self._batchers or {}).values():
            batcher.close()
        self._closing.set()
        if self._tasks:  # sessions closing in the background: let them finish
            await asyncio.wait(list(self._tasks), timeout=5.0)
        for ch in self._aio_channels:
            await ch.close()
        # What is left (streams' readers and writers, gRPC's own tasks, a late drafter's probe)
        # ends here, as asyncio.run ends a loop's tasks, not destroyed pending with the loop.
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def __enter__(self) -> "SpeculativeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- public API ---------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False, *,
                      tokenizer=None, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt: text (through the chat template as one user turn with `chat`),
        token ids (checked against the verifier's vocabulary), or chat messages ({"role",
        "content"} dicts, always through the chat template). tokenizer: a copy of the client's
        to use instead (callers that encode on several threads at once). add_special_tokens:
        plain text gets the tokenizer's own (a BOS for Llama, Mistral or Gemma; nothing for
        SmolLM2 or Qwen), as transformers and vLLM's completions do."""
        if isinstance(prompt, str):
            if chat:
                return self.encode_chat([{"role": "user", "content": prompt}], tokenizer=tokenizer)
            _check_text(prompt, "prompt")
            return list((tokenizer or self.tokenizer)(prompt, add_special_tokens=add_special_tokens).input_ids)
        if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            return self.encode_chat(prompt, tokenizer=tokenizer)
        try:
            if isinstance(prompt, (bytes, bytearray)) or any(isinstance(t, bool) for t in prompt):
                raise TypeError  # bytes iterate as ints, and True is an int: neither is token ids
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise TypeError("prompt must be a string, a sequence of token ids or a sequence of chat messages "
                            f"({{'role', 'content'}} dicts), got {type(prompt).__name__}") from None
        if chat:  # a template applies to text: ids would go out unchanged, which chat=True does not ask for
            raise ValueError("chat=True applies the chat template to a string or to messages; token ids are sent "
                             "as they are (apply the template when encoding them, or pass the text)")
        self.check_vocab(ids, "prompt")
        return ids

    def _past_drafter_vocab(self, ids: Sequence[int]) -> bool:
        """Whether any id is past the drafter's LM head (which may be smaller than the verifier's)."""
        info = self.drafter_info
        if info is None or info.vocab_size >= self.verifier_info.vocab_size:
            return False
        return max(ids, default=-1) >= info.vocab_size

    def check_vocab(self, ids: Sequence[int], field: str) -> None:
        """InvalidArgument (a ValueError) naming `field` and its first id outside the verifier's
        vocabulary."""
        vocab = self.verifier_info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad} is outside the verifier's vocabulary [0, {vocab})")

    def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tokenizer=None, add_special_tokens: bool = False,
                    **template_kwargs) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply
        (add_generation_prompt), or ending inside the last assistant message, which the reply
        then continues (continue_final_message). template_kwargs: the template's own variables;
        tokenizer: as encode_prompt's. add_special_tokens: the tokenizer's special tokens on top
        of the rendered template (vLLM's chat option; off, since templates write their own BOS)."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r}")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise ValueError(f"messages[{i}] ({m['role']}) needs a 'content' string or list of parts, "
                                 f"got {m.get('content')!r}")
            if isinstance(m.get("content"), str):
                _check_text(m["content"], f"messages[{i}].content")
        # No content (an assistant's tool call, or none given) is the empty string, as the gateway and
        # vLLM read it: a template's `message['content'] | trim` fails on None.
        messages = [m if m.get("content") is not None else {**m, "content": ""} for m in messages]
        tokenizer = tokenizer or self.tokenizer
        try:
            ids = tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=not add_special_tokens, **template_kwargs)
        except (TemplateError, TypeError) as exc:  # the template's own checks (roles, alternation, content)
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        if add_special_tokens:  # the rendered text, tokenized as a completion's prompt
            return list(tokenizer(ids, add_special_tokens=True).input_ids)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def costs(self, verifier_address: str) -> ServingCosts:
        """The load model of one verifier (and the drafters used with it), shared by every
        generation of this client."""
        costs = self._costs.get(verifier_address)
        if costs is None:
            with self._costs_lock:
                costs = self._costs.setdefault(verifier_address, ServingCosts(decode_steps=self.decode_steps))
        return costs

    def effective_gamma(self, gamma: int) -> int:
        """γ as rounds will use it: capped by both services' max_draft_tokens; 0 without a drafter
        (none given, or none has answered yet: then one that is due for a retry is asked)."""
        if gamma > 0 and self.drafter_info is None and self.drafters is not None:
            self._late_drafter()
        if gamma <= 0 or self.drafter_info is None:
            return 0
        return min(gamma, self.drafter_info.max_draft_tokens, self.verifier_info.max_draft_tokens)

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        params: SamplingParams = SamplingParams(),
        *,
        num_speculative_tokens: int | str | None = None,
        target_only: bool = False,
        chat: bool = False,
        fanout: int | None = None,
    ) -> GenerationResult:
        """The whole generation (`stream`'s last result), blocking this thread."""
        result = None
        for chunk in self.stream(prompt, params, num_speculative_tokens=num_speculative_tokens,
                                 target_only=target_only, chat=chat, fanout=fanout):
            result = chunk.result
        assert result is not None
        return result

    async def agenerate(self, prompt: str | Sequence[int] | Sequence[dict],
                        params: SamplingParams = SamplingParams(), **options) -> GenerationResult:
        """`generate` for a caller on its own event loop (not the client's); options as `stream`'s."""
        result = None
        async for chunk in self.astream(prompt, params, **options):
            result = chunk.result
        assert result is not None
        return result

    def stream(self, prompt: str | Sequence[int] | Sequence[dict], params: SamplingParams = SamplingParams(),
               **options) -> Iterator[StreamChunk]:
        """Yield the tokens committed by each round; the last chunk carries the result. For a
        caller on any thread but the client's loop, whose rounds run ahead of the reading.
        Stopping early (closing the iterator) ends the generation and waits for its sessions
        to close.

        options: num_speculative_tokens (γ, or "auto": adaptive γ in [0, 8] per round, see
        specdec/adaptive.py; with `params.seed` the schedule follows from this generation's own
        rounds, so the same seed gives the same output under any load); target_only; chat
        (text through the chat template); fanout (this generation's speculation-cache fanout).

        The first round never drafts: the verifier prefills the prompt and answers the first
        token as fast as target-only decoding. The drafter prefills when drafts are first
        wanted, in the background while target-only rounds go on ("auto"; a fixed γ and a
        seeded request wait for it, so that their rounds, hence their output, reproduce)."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        cancel = self._pump(self._stream(prompt, params, **options), items.put)
        ended = False
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    ended = True
                    _drain(items.get)
                    raise item
                yield item
            ended = True
        finally:
            if not ended:  # closed early (or interrupted): end the generation, let its sessions close
                cancel()
                _drain(lambda: items.get(timeout=_CLOSE_WAIT_S))

    async def astream(self, prompt: str | Sequence[int] | Sequence[dict],
                      params: SamplingParams = SamplingParams(), **options) -> AsyncIterator[StreamChunk]:
        """`stream` for a caller on its own event loop (not the client's): chunks cross to that
        loop as they come. Cancelling the caller (or closing the iterator) ends the generation."""
        caller = asyncio.get_running_loop()
        if caller is self._loop:
            raise RuntimeError("astream is for other event loops; on the client's own, use _stream")
        items: asyncio.Queue = asyncio.Queue()
        mailbox = self._mailboxes.get(caller)
        if mailbox is None:
            mailbox = self._mailboxes.setdefault(caller, _Mailbox(caller))
        cancel = self._pump(self._stream(prompt, params, **options), functools.partial(mailbox.put, items))
        ended = False
        try:
            while (item := await items.get()) is not _END:
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
            ended = True
        finally:
            if not ended:  # the caller stopped reading: end the generation, let its sessions close
                cancel()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_adrain(items), _CLOSE_WAIT_S)

    def _pump(self, chunks: AsyncIterator[StreamChunk], put: Callable[[object], None]) -> Callable[[], None]:
        """Run a generation on the client's loop, handing each chunk, then its error if any, then
        _END to `put` (also when it is cancelled before it starts). Returns what cancels it."""
        if self._closed:
            raise ClientClosed("the client is closed")
        task: list[asyncio.Task] = []

        async def pump() -> None:
            async for chunk in chunks:
                put(chunk)

        def done(t: asyncio.Task) -> None:
            self._pumps.discard(t)
            if t.cancelled():
                put(ClientClosed("the generation was cancelled: the client is closing (or its caller stopped)"))
            elif t.exception() is not None:
                put(t.exception())
            put(_END)

        def start() -> None:
            task.append(self._loop.create_task(pump()))
            self._pumps.add(task[0])
            task[0].add_done_callback(done)

        def cancel() -> None:
            with contextlib.suppress(RuntimeError):  # the client's loop is closed: close() ended it
                self._loop.call_soon_threadsafe(lambda: task[0].cancel())  # runs after start: FIFO

        self._loop.call_soon_threadsafe(start)
        return cancel

    async def _stream(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        params: SamplingParams = SamplingParams(),
        *,
        num_speculative_tokens: int | str | None = None,
        target_only: bool = False,
        chat: bool = False,
        fanout: int | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """`stream`'s chunks, on the client's loop: checks the request, then runs the rounds."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        gamma_max = self.num_speculative_tokens if num_speculative_tokens is None else _check_gamma(num_speculative_tokens)
        adaptive = gamma_max == AUTO
        if adaptive:
            gamma_max = AUTO_GAMMA_MAX
        fanout = self.fanout if fanout is None else _check_fanout(fanout)
        speculative = not target_only and gamma_max > 0
        if speculative and self.drafters is None:
            raise ValueError("speculative decoding needs a drafter address (or use target_only=True)")
        if speculative:
            gamma_max = self.effective_gamma(gamma_max)
        prompt_ids = self.encode_prompt(prompt, chat)
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenization")
        self.check_vocab(params.stop_token_ids, "stop_token_ids")
        self.check_vocab([t for t, _ in params.logit_bias], "logit_bias")
        self.check_vocab(params.allowed_token_ids or (), "allowed_token_ids")
        check_min_tokens(params, self.verifier_info.vocab_size, self.verifier_info.eos_token_ids)
        max_context = self.verifier_info.max_context
        if params.max_tokens is None:  # vLLM's rule: up to the context, prompt + max_tokens <= max_context
            if len(prompt_ids) >= max_context:
                raise InvalidArgument("max_tokens", f"the prompt's {len(prompt_ids)} tokens fill the verifier's "
                                                    f"maximum context {max_context}: no room for max_tokens=None")
            if params.min_tokens > max_context - len(prompt_ids):
                raise InvalidArgument("min_tokens", f"{params.min_tokens} is more than the {max_context - len(prompt_ids)} "
                                                    f"tokens left in the verifier's context {max_context} after the prompt")
            params = params.replace(max_tokens=max_context - len(prompt_ids))
        # The last token is never cached: a generation needs room for all but it (the gateway keeps
        # vLLM's rule, prompt + max_tokens <= the context, except for an echoed prompt's one token).
        if len(prompt_ids) + params.max_tokens - 1 > max_context:
            raise ValueError(
                f"prompt length {len(prompt_ids)} + max_tokens {params.max_tokens} exceeds the verifier's "
                f"maximum context {max_context} by more than the last token, which is never cached"
            )
        if speculative and self._past_drafter_vocab([*prompt_ids, *params.stop_token_ids]):
            log.info("prompt or stop token ids past the drafter's vocabulary (%d): this generation runs target-only",
                     self.drafter_info.vocab_size)
            speculative = False
        # A seeded request's γ schedule follows from its own rounds only (AdaptiveGamma.deterministic):
        # the seed keys every draw by position, so the same rounds give the same output under any load.
        controller = (AdaptiveGamma(gamma_min=0, gamma_max=gamma_max, deterministic=params.seed is not None)
                      if adaptive and speculative else None)
        async for chunk in self._run(prompt_ids, params, gamma_max if speculative else 0, controller, fanout):
            yield chunk

    # ---- rounds -------------------------------------------------------------------

    async def _run(self, prompt_ids: list[int], params: SamplingParams, gamma_max: int,
                   controller: AdaptiveGamma | None = None, fanout: int = 0) -> AsyncIterator[StreamChunk]:
        """The round loop: choose γ, draft, verify, commit, stream. Each side is told how far
        to truncate its cache from what the client remembers it holds (_lcp against `committed`)."""
        gen = await self._start(prompt_ids, params, gamma_max, controller, fanout)
        try:
            while not gen.output.finished:
                gamma = await self._plan_round(gen)
                # A side whose cache is empty (first round, new session) prefills in this round,
                # which would skew the adaptive cost estimates.
                steady = bool(gen.drafter.kv) and bool(gen.verifier.kv)
                fallbacks = gen.result.drafter_fallback_rounds
                drafts, proposal, draft_s = await self._draft_round(gen, gamma)
                lost = gen.result.drafter_fallback_rounds > fallbacks  # no drafter answered this round
                steps = self._decode_steps(gen, drafter_lost=lost) if not drafts else 1
                response, verify_s = await self._verify_round(gen, drafts, proposal, steps)
                if gen.controller is not None and steady and steps == 1:
                    # (a round of several steps is no sample of one round's cost at γ 0)
                    gen.controller.update(len(drafts), response.num_accepted, draft_s, verify_s)
                elif gen.controller is not None and steps > 1:
                    gen.controller.note_decode_steps(len(response.output_token_ids))
                logprobs = (_logprobs_from_pb(response.output_token_ids, response.logprobs)
                            if gen.result.logprobs is not None else None)
                chunk = gen.output.commit(response.output_token_ids, logprobs, time.perf_counter())
                if gen.result.num_rounds == 1 and params.prompt_logprobs is not None:  # the round that prefilled
                    if len(response.prompt_logprobs) != gen.prompt_length - 1:
                        raise RuntimeError(f"the verifier {gen.verifier.server.address} answered "
                                           f"{len(response.prompt_logprobs)} prompt logprobs for a prompt of "
                                           f"{gen.prompt_length} tokens: it does not support prompt_logprobs")
                    scored = _logprobs_from_pb(gen.result.prompt_token_ids[1:], response.prompt_logprobs)
                    gen.result.prompt_logprobs = [None, *scored]
                    chunk = replace(chunk, prompt_logprobs=gen.result.prompt_logprobs)
                gen.committed += chunk.token_ids
                if gen.gamma_max and self._past_drafter_vocab(chunk.token_ids):
                    # The target chose a padding row of its larger head: the drafter cannot take
                    # that id, so the rest of the generation is target-only (still exact).
                    log.info("session=%s: the target emitted an id past the drafter's vocabulary (%d); target-only "
                             "rounds from here", gen.verifier.session_id, self.drafter_info.vocab_size)
                    gen.gamma_max = 0
                yield chunk
        finally:
            await self._finish(gen)

    async def _start(self, prompt_ids: list[int], params: SamplingParams, gamma_max: int,
                     controller: AdaptiveGamma | None, fanout: int) -> "_Generation":
        """A generation's state, with its verifier session open (the drafter's opens when drafts
        are first wanted: a generation that never drafts never waits for the drafter)."""
        t0 = time.perf_counter()
        fmt = self.proposal_format or ProposalFormat(kind=IDS_ONLY if params.greedy else DENSE)
        if params.method != REJECTION:
            fmt = ProposalFormat(kind=IDS_ONLY)  # greedy and typical acceptance never read q
        result = GenerationResult(text="", token_ids=[], prompt_token_ids=list(prompt_ids), finish_reason="length",
                                  target_only=gamma_max == 0, logprobs=[] if params.logprobs is not None else None)
        # Everything that can refuse the request comes before the session opens: nothing to leak.
        sampling, proposal_format = sampling_to_pb(params), proposal_format_to_pb(fmt)
        output = OutputProcessor(self.tokenizer, params, self.verifier_info.eos_token_ids, result, t0)
        verifier = _Link()
        await self._open_verifier_session(verifier, result)
        gen = _Generation(
            sampling=sampling, proposal_format=proposal_format,
            prompt_length=len(prompt_ids), committed=list(prompt_ids), result=result, output=output,
            verifier=verifier, drafter=_DrafterLink(gamma_max=gamma_max, max_draft_tokens=gamma_max, fanout=fanout),
            gamma_max=gamma_max, controller=controller, counted_on=self.costs(verifier.server.address),
            drafter_context=self.drafter_info.max_context if self.drafter_info else 0,
            verifier_context=self.verifier_info.max_context,
            shared_device=shares_device(self.drafter_info, self.verifier_info),
        )
        gen.counted_on.begin()
        gen.counted_on.shared_gpu_cap = shared_gpu_cap(self.drafter_info, self.verifier_info)
        if controller is not None:
            controller.attach(gen.counted_on)
        return gen

    async def _finish(self, gen: "_Generation") -> None:
        """Once per generation, at its end (close() ends running generations by cancelling them)."""
        gen.counted_on.end()
        if self.drafters is not None:
            if gen.drafter.prefill is not None:  # of no use now; the session closes next
                gen.drafter.prefill[0].cancel()
                gen.drafter.prefill = None
            self._end_drafter(gen.drafter)
        await self._end_verifier(gen.verifier)

    async def _plan_round(self, gen: "_Generation") -> int:
        """This round's γ: the controller's (or the fixed γ), never more than can be kept, and 0
        while the drafter's background prefill has not landed; starts that prefill when due."""
        link, committed = gen.drafter, gen.committed
        remaining = gen.output.params.max_tokens - len(gen.result.token_ids)
        # Never draft more than can be kept: the round emits up to gamma + 1 tokens. Except with a
        # seed: its rounds (hence its draws) must not depend on max_tokens, so that a shorter
        # run is a prefix of a longer one; the output processor drops what is past max_tokens.
        keepable = remaining - 1 if gen.output.params.seed is None else gen.verifier_context - len(committed) - 1
        room = max(0, min(keepable, gen.drafter_context - len(committed)))
        if not gen.gamma_max or gen.result.num_rounds == 0:
            cap = 0  # the first token is the verifier's alone (target-only TTFT)
        elif gen.controller is not None:
            gen.controller.costs = self.costs(gen.verifier.server.address)
            # Within what can be kept: a probe due in a round with no room for drafts (a
            # generation's last) waits for a round that has some, instead of being spent on none.
            cap = gen.controller.next_gamma(min(link.max_draft_tokens, room))
        else:
            cap = link.max_draft_tokens
        gamma = min(cap, room)
        waited = link.prefill is not None  # a prefill started in an earlier round
        if gamma and link.prefill is None and self._drafter_behind(link, committed):
            if gen.controller is not None and gen.controller.probing:
                # A probe where the drafter holds nothing: it catches up in the background and a
                # later round drafts (only drafting rounds refresh the estimates that chose γ 0).
                gen.controller.defer_probe()
                await self._start_prefill(gen)
                return 0
            # A prompt (or a long run of target-only rounds) to catch up on: the drafter
            # prefills in the background, only once drafts are wanted at all.
            await self._start_prefill(gen)
        elif (gen.result.num_rounds == 0 and gen.gamma_max and link.prefill is None and not gen.shared_device
              and min(remaining - 1, gen.drafter_context - len(committed)) > 0
              and (gen.controller is None or gen.controller.best_gamma(link.max_draft_tokens) > 0)):
            # Drafts will be wanted from the second round on: the drafter prefills the prompt
            # now, beside the verifier's prefill, on its own device.
            await self._start_prefill(gen)
        if link.prefill is None:
            return gamma
        # A fixed γ and a seeded request wait for it (their rounds reproduce). Adaptive rounds on
        # separate devices run one target-only round beside it, then wait when they want drafts.
        # Both services on one device (CPUs, or one GPU): a session alone waits at once
        # (target-only rounds beside the prefill would only take turns with it); beside other
        # sessions it never waits, since the drafter then takes turns with the others' verifies.
        if gen.controller is None or gen.controller.deterministic:
            block = True
        elif gen.shared_device:
            block = self.costs(gen.verifier.server.address).running <= 1
        else:
            block = waited
        await self._collect_prefill(gen, block=gamma > 0 and block)
        return gamma if link.prefill is None else 0

    def _decode_steps(self, gen: "_Generation", drafter_lost: bool = False) -> int:
        """Target-only steps for a round without drafts: 1 for a generation's first round (its
        first token is the TTFT), while the drafter catches up in the background (drafts come
        back soon) and for a probe that could not draft; else up to decode_steps, within
        max_tokens (a seeded run stays a prefix of a longer one: its tokens are keyed by
        position, whatever the rounds). drafter_lost: no drafter answered this round."""
        if gen.result.num_rounds == 0 or gen.drafter.prefill is not None:
            return 1
        if gen.gamma_max and gen.controller is None and not drafter_lost:
            # A fixed γ's other rounds without drafts are its last (max_tokens) or wait for its
            # drafter; without one, it ran a call per token until the drafter came back (1,848
            # rounds for 1,900 tokens after a drafter was killed)
            return 1
        if gen.controller is not None and gen.controller.probing:
            return 1
        remaining = gen.output.params.max_tokens - len(gen.result.token_ids)
        return max(1, min(self.decode_steps, remaining))

    async def _draft_round(self, gen: "_Generation", gamma: int) -> tuple[list[int], pb.Proposal | None, float]:
        """(drafts, their proposal, seconds): none for γ 0 or while no drafter is reachable."""
        ts = time.perf_counter()
        drafts, proposal = await self._draft(gen, gamma) if gamma else ([], None)
        draft_s = time.perf_counter() - ts
        if drafts and gen.drafter.observed is not None:
            self.costs(gen.verifier.server.address).observe_draft(*gen.drafter.observed)
        return drafts, proposal, draft_s

    async def _verify_round(self, gen: "_Generation", drafts: list[int], proposal: pb.Proposal | None,
                            decode_steps: int = 1) -> tuple[pb.VerifyResponse, float]:
        """Score the drafts on the verifier (or decode up to decode_steps tokens target-only):
        (its answer, seconds). A lost verifier session is
        re-opened on the pool and re-prefilled from `committed`, for up to recovery_timeout_s;
        the drafts stay valid, since they were proposed for `committed`, which is unchanged."""
        verifier, committed, result = gen.verifier, gen.committed, gen.result
        ts = time.perf_counter()
        give_up = None  # recovery_timeout_s counts from the first failure, not from the call: a hung
        while True:     # verifier takes all of timeout_s to fail, which used to leave no budget at all
            keep = _lcp(verifier.kv, committed, len(committed) - 1)
            request = pb.VerifyRequest(session_id=verifier.session_id, truncate_to=keep,
                                       append_token_ids=committed[keep:], draft_token_ids=drafts,
                                       sampling=gen.sampling, prompt_length=gen.prompt_length,
                                       decode_steps=decode_steps if decode_steps > 1 else 0)
            if proposal is not None:
                request.proposal.CopyFrom(proposal)
            try:
                response = await self._verify(verifier.server, request, self.timeout_s)
                break
            except grpc.RpcError as exc:
                give_up = give_up or time.monotonic() + self.recovery_timeout_s
                if exc.code() not in _VERIFIER_LOST:
                    raise
                if time.monotonic() > give_up:  # lost again after a late re-open (a flapping verifier)
                    raise self._no_verifier(exc) from exc
                log.warning("verifier %s lost session=%s code=%s details=%r; re-opening it on the pool for "
                            "up to %.0f s", verifier.server.address, verifier.session_id, exc.code().name,
                            exc.details(), self.recovery_timeout_s)
                await self._lose(self.verifiers, verifier, exc.code(), close=True)  # after a deadline it may exist
                await self._open_verifier_session(verifier, result, exc)
                result.verifier_recoveries += 1
        verify_s = time.perf_counter() - ts
        # One engine step (no chunked prompt, no background prefill of ours competing for a
        # shared host's cores) is a sample of the verifier's step cost.
        self.costs(verifier.server.address).observe_verify(
            load_from_pb(response.load), verify_s, fit=len(committed) - keep <= 2 and gen.drafter.prefill is None,
            steps=len(response.output_token_ids) if decode_steps > 1 else 1)
        verifier.kv = committed + list(response.output_token_ids[:-1])
        _check_kv("verifier", response.kv_length, len(verifier.kv))
        result.verify_time_s += verify_s
        result.verify_device_s += response.load.device_ms / 1e3
        result.verify_step_s += response.load.step_ms / 1e3
        result.num_rounds += 1
        result.num_draft_tokens += len(drafts)
        result.num_accepted_tokens += response.num_accepted
        result.num_speculative_rounds += bool(drafts)
        result.gamma_per_round.append(len(drafts))
        log.debug("session=%s round=%d drafts=%d accepted=%d", verifier.session_id, result.num_rounds, len(drafts),
                  response.num_accepted)
        return response, verify_s

    # ---- fault tolerance ------------------------------------------------------------

    async def _draft(self, gen: "_Generation", gamma: int, attempt: int = 0) -> tuple[list[int], pb.Proposal | None]:
        """This round's drafts and their proposal, or none while no drafter is reachable:
        the round is then a target-only step, which leaves the output distribution as it is.
        A lost session moves at once, in this round, to another drafter of the pool (its first
        Draft re-prefills `committed`); `attempt` counts this round's tries."""
        link, committed, result = gen.drafter, gen.committed, gen.result
        if link.session_id is None and not await self._connect_drafter(gen):
            result.drafter_fallback_rounds += 1
            return [], None
        keep = _lcp(link.kv, committed, len(committed) - 1)
        ts = time.perf_counter()
        try:
            resp = await link.server.astub.Draft(
                pb.DraftRequest(session_id=link.session_id, truncate_to=keep, append_token_ids=committed[keep:],
                                num_draft_tokens=min(gamma, link.max_draft_tokens), sampling=gen.sampling,
                                proposal_format=gen.proposal_format, prompt_length=gen.prompt_length,
                                fanout=link.fanout),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            if exc.code() not in _DRAFTER_LOST:
                raise
            log.warning("drafter %s lost session=%s code=%s details=%r; moving it to another drafter, else "
                        "target-only rounds until one is back", link.server.address, link.session_id,
                        exc.code().name, exc.details())
            result.drafter_failures += 1
            await self._lose(self.drafters, link, exc.code())
            resp = None
        finally:
            result.draft_time_s += time.perf_counter() - ts
        if resp is None:
            if attempt < len(self.drafters):  # each drafter of the pool may fail once per round
                return await self._draft(gen, gamma, attempt + 1)
            result.drafter_fallback_rounds += 1
            return [], None
        drafts = list(resp.draft_token_ids)
        # A sample of the drafter's step cost when it ran one step per draft for this session
        # (no long catch-up, no pre-drafted branch).
        link.observed = None
        if len(committed) - keep <= 2 and resp.cached_draft_tokens == 0 and drafts:
            link.observed = (load_from_pb(resp.load), time.perf_counter() - ts, len(drafts))
        result.proposal_bytes += len(resp.proposal.probs) + len(resp.proposal.token_ids)
        # device ms is a mean per draft step; pre-drafted (cached) drafts ran no step for this call
        result.draft_device_s += resp.load.device_ms * max(len(drafts) - resp.cached_draft_tokens, 0) / 1e3
        result.cached_draft_tokens += resp.cached_draft_tokens
        result.speculation_hits += int(0 < len(drafts) == resp.cached_draft_tokens)
        link.kv = committed + drafts[:-1]
        _check_kv("drafter", resp.kv_length, len(link.kv))
        return drafts, resp.proposal

    @staticmethod
    def _drafter_behind(link: "_DrafterLink", committed: list[int]) -> bool:
        """The drafter holds nothing of this sequence, or lags more than ASYNC_CATCHUP_TOKENS."""
        return not link.kv or len(committed) - _lcp(link.kv, committed, len(committed)) > ASYNC_CATCHUP_TOKENS

    async def _start_prefill(self, gen: "_Generation") -> None:
        """Bring the drafter's cache up to `committed` in the background (a Draft of γ 0), off
        the critical path: the rounds go on without drafts until it lands (_collect_prefill)."""
        link, committed = gen.drafter, gen.committed
        if link.session_id is None and not await self._connect_drafter(gen):
            return
        keep = _lcp(link.kv, committed, len(committed) - 1)
        req = pb.DraftRequest(session_id=link.session_id, truncate_to=keep, append_token_ids=committed[keep:],
                              num_draft_tokens=0, sampling=gen.sampling, proposal_format=gen.proposal_format,
                              prompt_length=gen.prompt_length)
        link.prefill = (asyncio.ensure_future(link.server.astub.Draft(req, timeout=self.timeout_s)), list(committed))

    async def _collect_prefill(self, gen: "_Generation", block: bool) -> None:
        """Take the background prefill's answer if it is there (or wait for it with `block`).
        A lost drafter is handled as in _draft: the next round moves the session."""
        link, result = gen.drafter, gen.result
        future, sequence = link.prefill
        if not block and not future.done():
            return
        link.prefill = None
        try:
            resp = await future
        except grpc.RpcError as exc:
            if exc.code() not in _DRAFTER_LOST:
                raise
            log.warning("drafter %s lost session=%s during its prefill code=%s details=%r", link.server.address,
                        link.session_id, exc.code().name, exc.details())
            result.drafter_failures += 1
            await self._lose(self.drafters, link, exc.code())
            return
        link.kv = sequence
        _check_kv("drafter", resp.kv_length, len(link.kv))

    async def _connect_drafter(self, gen: "_Generation") -> bool:
        """Open a drafter session on the least-loaded drafter that answers (its first Draft
        prefills all committed tokens). False if none does now; the pool's backoff decides
        when each drafter is tried again, so a round while all are down costs no call."""
        link, result = gen.drafter, gen.result
        lost_from = link.lost_from
        result.drafter_failures += len(await self._open_session(self.drafters, link, _DRAFTER_LOST,
                                                                self._check_drafter))
        if link.session_id is None:
            return False
        link.max_draft_tokens = min(link.gamma_max, link.info.max_draft_tokens)
        result.drafter_failovers += _note_server(link, lost_from, result.drafter_addresses)
        if lost_from is not None:
            log.info("drafter session=%s on %s; speculation resumes", link.session_id, link.server.address)
        return True

    def _no_verifier(self, error: grpc.RpcError) -> NoServerAvailable:
        """One exception for "every verifier is gone", whatever the last call's status
        (UNAVAILABLE, DEADLINE_EXCEEDED from a frozen one), naming the pool."""
        hint = (f" (each call's deadline is timeout_s = {self.timeout_s:g} s)"
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "")
        return NoServerAvailable(
            f"no verifier of {', '.join(s.address for s in self.verifiers.servers)} answered within "
            f"{self.recovery_timeout_s:g} s; the last error: {error.code().name}: {error.details()}{hint}")

    async def _open_verifier_session(self, link: "_Link", result: GenerationResult,
                                     error: grpc.RpcError | None = None) -> None:
        """Open `link`'s verifier session on the least-loaded verifier that answers, waiting
        out the pool's backoff for up to recovery_timeout_s, then raising NoServerAvailable from
        the latest connection error, else `error` (the call that lost the previous session). The
        caller re-prefills."""
        deadline = time.monotonic() + self.recovery_timeout_s
        queue_deadline = time.monotonic() + self.timeout_s  # one bound on queueing, however many turns it takes
        lost_from = link.lost_from
        poll = _REFUSED_POLL_S
        last_try = False  # made at the deadline when the backoff would put the next one past it
        in_line = False  # this generation has had its turn in the pool's queue
        ticket = None  # its place in that queue while shared verifiers refuse it
        refusal = ""  # the last refusal's details

        async def wait_for_room() -> None:  # first in the pool's line, and room on a verifier
            if not await self.verifiers.wait_for_room(max(0.0, queue_deadline - time.monotonic())):
                raise TimeoutError(f"every verifier held its maximum of sessions for {self.timeout_s:g} s "
                                   f"({self.verifiers.live_sessions()}); raise --max-sessions or add verifiers")

        def refused_too_long() -> TimeoutError:
            return TimeoutError(f"every verifier refused a session for {self.timeout_s:g} s (the last: {refusal}); "
                                "raise --max-sessions or add verifiers")

        try:
            while True:
                if not in_line and ticket is None and self.verifiers.queued():
                    # Others wait for room: a newcomer takes its place behind them, first come first served.
                    in_line = True
                    await wait_for_room()
                if ticket is not None and not self.verifiers.first(ticket):
                    # Refused before, and behind generations refused earlier: they try first.
                    if time.monotonic() >= queue_deadline:
                        raise refused_too_long()
                    await asyncio.sleep(_REFUSED_POLL_S)
                    continue
                refused: list[grpc.RpcError] = []
                errors = await self._open_session(self.verifiers, link, _VERIFIER_LOST, self._check_verifier,
                                                  refused, patient=last_try)
                if link.session_id is not None:
                    break
                if refused:
                    # A verifier this client shares with others (other gateways, other processes)
                    # had every session mid-call: it admits one as soon as a call ends and a session
                    # is idle to evict. Queue in line, for up to timeout_s, as for this client's own.
                    ticket = ticket or self.verifiers.enqueue()
                    refusal = refused[-1].details()
                    left = queue_deadline - time.monotonic()
                    if left <= 0:
                        raise refused_too_long()
                    await asyncio.sleep(min(poll, left))
                    poll = min(2 * poll, _POLL_S)
                    deadline = time.monotonic() + self.recovery_timeout_s
                    continue
                if ticket is not None:  # not refused any more: out of line
                    self.verifiers.dequeue(ticket)
                    ticket = None
                poll = _REFUSED_POLL_S
                if not errors and self.verifiers.full():
                    # Queued: every verifier holds all the sessions it admits; one frees when a
                    # generation ends. (Picking one anyway would evict an idle session to re-prefill.)
                    in_line = True
                    await wait_for_room()
                    deadline = time.monotonic() + self.recovery_timeout_s
                    continue
                error = errors[-1] if errors else error  # the latest: a restart's CANCELLED, then refusals
                now = time.monotonic()  # before wait_s reads the clock: a try due at the deadline is within it
                wait = self.verifiers.wait_s()
                if wait is None:
                    raise IncompatibleModels("no verifier of the pool serves the client's model any more: " +
                                             "; ".join(f"{s.address}: {s.disabled}" for s in self.verifiers.servers))
                if now + wait > deadline:
                    if not last_try and now < deadline:
                        # A verifier back within the window was given up on because its backoff (up
                        # to 4 s) put its next try past the deadline: try once more at the deadline.
                        self.verifiers.retry_by(deadline)
                        last_try = True
                        continue
                    if error is None:
                        raise NoServerAvailable(f"no verifier could be tried within {self.recovery_timeout_s:g} s "
                                                "(each was down at its last try and is not due for another yet)")
                    raise self._no_verifier(error) from error
                # In slices: a session another generation re-opens meanwhile clears the backoff.
                await asyncio.sleep(min(max(wait, 0.01), _POLL_S))
        finally:
            if ticket is not None:
                self.verifiers.dequeue(ticket)
        result.verifier_failovers += _note_server(link, lost_from, result.verifier_addresses)
        if lost_from is not None:
            log.info("verifier session=%s on %s; re-prefilling", link.session_id, link.server.address)

    async def _open_session(self, pool: ServerPool, link: "_Link", lost: frozenset, check,
                            refused: list[grpc.RpcError] | None = None, patient: bool = False) -> list[grpc.RpcError]:
        """Open a session for `link` on the least-loaded ready server of `pool`, trying each
        at most once. A server not known to fit since its last failure is asked for its model
        first and `check`ed (one that fails is left out of the pool for good). Returns the
        connection errors met; link.session_id stays None if no server took the session. With
        `refused`, a server that answers RESOURCE_EXHAUSTED (no session idle to evict) is full
        for now, not down: its error goes there and the rest of the pool is tried. `patient` (a
        caller's last try): a down server's first call waits for its channel's next reconnect
        attempt instead of failing at once in the channel's backoff."""
        short = min(self.timeout_s, 5.0)
        tried: list[Server] = []
        errors: list[grpc.RpcError] = []
        # Drafts are optional: a drafter that is down is only ever retried in the background, the
        # rounds going on target-only meanwhile; a verifier in the path only when none is up.
        drafts = pool is self.drafters
        if patient:
            # The last try: every down server at once, each call waiting for its channel's next
            # reconnect. One after another, a pool of a killed verifier and three dead addresses
            # failed after 14 s against a recovery_timeout_s of 2.
            # Held tasks, shielded: a generation cancelled meanwhile (its HTTP caller left) must not
            # leave a claimed server marked as probing for good, never retried.
            await asyncio.shield(asyncio.gather(*(self._held(self._reprobe(pool, server, check, patient=True))
                                                  for server in pool.claim_due(always=True))))
        else:
            for server in pool.claim_due(always=drafts):
                self._held(self._reprobe(pool, server, check))
        while (server := pool.pick(exclude=tried, retry_down=not drafts)) is not None:
            tried.append(server)
            info = server.info
            try:
                if info is None:
                    # A server restarted since its channel's last reconnect attempt is found at the
                    # next one (within RECONNECT_BACKOFF_MAX_S); till then calls fail UNAVAILABLE.
                    info = model_info_from_pb(await server.astub.GetModelInfo(
                        pb.ModelInfoRequest(), timeout=min(short, RECONNECT_BACKOFF_MAX_S + 1.0) if patient else short,
                        wait_for_ready=patient or None))
                    check(info)
                opening = asyncio.ensure_future(server.astub.OpenSession(pb.OpenSessionRequest(), timeout=short))
                try:
                    opened = await asyncio.shield(opening)
                except asyncio.CancelledError:  # the server may open it anyway: close it once it answers
                    self._background(lambda: self._close_when_open(server, opening))
                    raise
                if opened.instance_id and info.instance_id and opened.instance_id != info.instance_id:
                    # Restarted since its model was checked, between this client's calls (a redeploy,
                    # perhaps of another model): check what it serves now before using the session.
                    fresh = model_info_from_pb(await server.astub.GetModelInfo(pb.ModelInfoRequest(), timeout=short))
                    try:
                        check(fresh)
                    except IncompatibleModels:
                        await self._close_quietly(server.astub, opened.session_id)
                        raise
                    info = fresh
                session_id = opened.session_id
            except grpc.RpcError as exc:
                pool.release(server)
                if refused is not None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    log.info("%s %s is full (%s); trying the rest of the pool", pool.role, server.address,
                             exc.details())
                    refused.append(exc)
                    continue
                if exc.code() not in lost:
                    raise
                log.info("%s %s unavailable code=%s; trying the rest of the pool", pool.role, server.address,
                         exc.code().name)
                pool.failed(server)
                if not (patient and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                    errors.append(exc)  # (a patient call's timeout says less than the refusal before it)
                continue
            except IncompatibleModels as exc:
                pool.release(server)
                pool.disable(server, str(exc))
                log.error("%s %s no longer fits the pool (%s); it is left out from here", pool.role, server.address,
                          exc)
                continue
            except BaseException:  # cancelled (the caller left, the client closes): the slot goes back
                pool.release(server)
                raise
            pool.succeeded(server, info)
            link.server, link.info, link.session_id, link.kv = server, info, session_id, []
            break
        return errors

    async def _reprobe(self, pool: ServerPool, server: Server, check, patient: bool = False) -> ModelInfo | None:
        """A down server's retry, off every generation's path: its model, checked; None while it
        is still down (or no longer fits, and is left out). `patient` (a caller's last try): the
        call waits for its channel's next reconnect attempt instead of failing in its backoff."""
        short = min(self.timeout_s, 5.0)
        try:
            info = model_info_from_pb(await server.astub.GetModelInfo(
                pb.ModelInfoRequest(), timeout=min(short, RECONNECT_BACKOFF_MAX_S + 1.0) if patient else short,
                wait_for_ready=patient or None))
            check(info)
        except IncompatibleModels as exc:
            pool.disable(server, str(exc))
            log.error("%s %s does not fit the pool (%s); it is left out", pool.role, server.address, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - still down (or not of its role): tried again after its backoff
            pool.failed(server)
            log.debug("%s %s still not answering: %r", pool.role, server.address, exc)
            return None
        pool.succeeded(server, info)
        log.info("%s %s answers (%s)", pool.role, server.address, info.model)
        return info

    def _check_verifier(self, info: ModelInfo) -> None:
        """A verifier joining the pool later (or coming back) must serve the same target
        within the limits the client already uses."""
        _check_same_target(info, self.verifier_info)
        if (info.max_context < self.verifier_info.max_context
                or info.max_draft_tokens < self.verifier_info.max_draft_tokens):
            raise IncompatibleModels(
                f"verifier limits (context {info.max_context}, max γ {info.max_draft_tokens}) are below the "
                f"pool's ({self.verifier_info.max_context}, {self.verifier_info.max_draft_tokens})")

    def _check_drafter(self, info: ModelInfo) -> None:
        """A drafter joining the pool later (or coming back): one vocabulary with the verifier,
        and room for the context the client plans drafts for (a smaller γ cap is fine)."""
        check_compatible(info, self.verifier_info)
        if self.drafter_info is not None and info.max_context < self.drafter_info.max_context:
            raise IncompatibleModels(
                f"drafter context {info.max_context} is below the pool's {self.drafter_info.max_context}")
        if self.drafter_info is not None and info.vocab_size < self.drafter_info.vocab_size:
            raise IncompatibleModels(
                f"drafter vocab_size {info.vocab_size} is below the pool's {self.drafter_info.vocab_size}")

    async def _lose(self, pool: ServerPool, link: "_Link", code: grpc.StatusCode, close: bool = False) -> None:
        """`link`'s session is gone: give its slot back and tell the pool. NOT_FOUND means
        the server answered (restarted, evicted, expired): no backoff, only a model re-check."""
        server, session_id = link.server, link.session_id
        pool.release(server)
        pool.failed(server, immediate=code == grpc.StatusCode.NOT_FOUND)
        link.server, link.info, link.session_id, link.kv, link.lost_from = None, None, None, [], server
        if close or code in _MAY_STILL_EXIST:
            # Off the round's path: the rounds go on elsewhere. A hung server's close waited its
            # whole deadline there (+5 s to every failover); it is retried while the server does
            # not answer, since one that resumes still holds the session (its KV until the TTL).
            self._held(self._close_quietly(server.astub, session_id, retry_for_s=_LOST_CLOSE_RETRY_S))

    async def _end_verifier(self, link: "_Link") -> None:
        """Close the session and wait for it. A generation cancelled meanwhile (a caller that
        stops reading at the last chunk, as the gateway does) stops waiting, not closing: the
        close goes on in the background, where close() waits for it."""
        if link.session_id is not None:
            server, session_id = link.server, link.session_id
            link.server, link.session_id = None, None
            try:
                await asyncio.shield(self._held(self._close_quietly(server.astub, session_id)))
            finally:
                self.verifiers.release(server)

    def _end_drafter(self, link: "_Link") -> None:
        """In the background: the generation is over, and a drafter on cores a busy verifier
        holds may answer late; close() waits for these."""
        if link.session_id is not None:
            server, session_id = link.server, link.session_id
            link.server, link.session_id = None, None
            self.drafters.release(server)
            self._background(lambda: self._close_quietly(server.astub, session_id))

    async def _close_when_open(self, server: Server, opening: asyncio.Future) -> None:
        try:
            opened = await opening
        except grpc.RpcError:
            return
        await self._close_quietly(server.astub, opened.session_id)

    async def _close_quietly(self, stub, session_id: str, retry_for_s: float = 0.0) -> None:
        """CloseSession; while the server does not answer (DEADLINE_EXCEEDED, or UNAVAILABLE:
        a keepalive timeout against a frozen server), retried for up to `retry_for_s` (5 s
        apart, doubling to 60 s). When the client closes, a retry that waits tries once more
        at once (within close()'s wait), so a server that resumed meanwhile drops the session
        now instead of holding it until its TTL."""
        waited, delay = 0.0, 5.0
        while True:
            last = retry_for_s > 0 and self._closing.is_set()  # a lost session's last try, at close
            try:
                # The last try waits for the channel to reconnect (its backoff after the keepalive
                # failure would fail it at once), within close()'s wait.
                # At least _CLOSE_MIN_S whatever timeout_s: a close that times out leaves the
                # session on the server until its TTL (a 1 ms timeout_s left every one open).
                timeout = max(min(self.timeout_s, 2.0 if last else 5.0), _CLOSE_MIN_S)
                await stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=timeout,
                                        wait_for_ready=last)
                return
            except grpc.RpcError as exc:  # the session expires on the server anyway
                unanswered = exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                if unanswered and waited + delay <= retry_for_s and not last:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._closing.wait(), delay)
                    waited, delay = waited + delay, min(2 * delay, 60.0)
                    continue
                # After a restart or an eviction the session is simply gone, and a lost session's
                # last try finding its server still away is what the retries before it found:
                # nothing to report.
                expected = exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE) or (
                    last and unanswered)
                log.log(logging.DEBUG if expected else logging.WARNING, "CloseSession %s failed: %s", session_id,
                        exc.code())
                return


def _check_text(text: str, what: str) -> None:
    """Text a tokenizer can take: valid Unicode (a lone surrogate failed deep in the tokenizer
    with a TypeError)."""
    if (where := invalid_text(text)) is not None:
        raise ValueError(f"{what} is not valid Unicode text: {where} (a lone surrogate, or bytes that are not UTF-8)")


# Status codes after which a side's session is gone or its server unreachable. Anything
# else (INVALID_ARGUMENT, ...) is a wrong request and propagates. The drafter also falls
# back when it is full (RESOURCE_EXHAUSTED), fails on its own (INTERNAL, UNKNOWN: a model
# it cannot serve) or refuses this client's credentials (UNAUTHENTICATED, PERMISSION_DENIED):
# drafts are optional, the verifier is not, and the output is the same.
_DRAFTER_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAUTHENTICATED,
                           grpc.StatusCode.PERMISSION_DENIED})
_VERIFIER_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED})
# A lost session that the server may still hold (it answered with its own failure, or the
# call ran past its deadline): closed in the background, or it would hold its KV for the TTL.
# UNAVAILABLE too: a server frozen past the keepalive timeout ("ping timeout") still holds the
# session when it resumes, for its TTL (a hunt froze one for 25 s: 4 sessions held 10 minutes).
_MAY_STILL_EXIST = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.UNAVAILABLE})
_LOST_CLOSE_RETRY_S = 300.0  # how long a lost session's close is retried: half the default session TTL
_POLL_S = 0.25  # how often a generation waiting for a verifier looks at the pool again
_REFUSED_POLL_S = 0.02  # the first wait after a verifier refused a session (doubling to _POLL_S)


@dataclass
class _Link:
    """One generation's session on one server of a pool (None while it has none), the
    model info that server answered with, and the tokens the session's KV cache holds."""

    server: Server | None = None
    info: ModelInfo | None = None
    session_id: str | None = None
    kv: list[int] = field(default_factory=list)
    lost_from: Server | None = None  # the server of the session lost last: a move elsewhere is a failover


@dataclass
class _DrafterLink(_Link):
    gamma_max: int = 0  # this generation's γ
    fanout: int = 0  # speculation cache: bonus candidates the drafter pre-drafts
    max_draft_tokens: int = 0  # γ on the current drafter: min(gamma_max, its max_draft_tokens)
    prefill: tuple | None = None  # (future of a background Draft of γ 0, the sequence it appends)
    observed: tuple | None = None  # (EngineLoad, latency s, steps) of the last Draft, when it samples the step cost


@dataclass(eq=False)  # by identity: a client's live generations are a set
class _Generation:
    """One generation across its rounds. `committed` (prompt + generated tokens) is the source
    of truth: each round truncates both sessions to their longest prefix that agrees with it,
    and a session lost on either side is replaced by one re-prefilled from it."""

    sampling: pb.SamplingParams
    proposal_format: pb.ProposalFormat
    prompt_length: int
    committed: list[int]
    result: GenerationResult
    output: OutputProcessor
    verifier: _Link
    drafter: _DrafterLink
    gamma_max: int  # 0: target-only rounds
    controller: AdaptiveGamma | None  # γ "auto"; None for a fixed γ
    counted_on: ServingCosts  # the load model that counts this generation as running (begin / end)
    drafter_context: int  # drafts end at the drafter's max_context
    verifier_context: int  # and a round's tokens at the verifier's
    shared_device: bool  # both engines on one device (shares_device): their work takes turns, never overlaps


class _Mailbox:
    """Chunks on their way from the client's loop to the readers on one other event loop, one
    wake-up for all that is waiting: a step's reply completes the rounds of many generations in
    one tick of the client's loop, and a call_soon_threadsafe per chunk would cost a self-pipe
    write (a syscall) each; at 64 generations that was a seventh of the loop's busy time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # weak: the client keeps one per loop, keyed weakly by it
        self._items: collections.deque = collections.deque()  # (queue, item); appended on the client's loop
        self._scheduled = False

    def put(self, items: asyncio.Queue, item: object) -> None:
        """On the client's loop."""
        self._items.append((items, item))
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop().call_soon_threadsafe(self._deliver)
            except (AttributeError, RuntimeError):  # the readers' loop is gone or closed: nobody reads
                self._scheduled = False
                self._items.clear()

    def _deliver(self) -> None:
        """On the readers' loop. Cleared first: what is put after this point schedules another."""
        self._scheduled = False
        pending = self._items
        while pending:
            items, item = pending.popleft()
            items.put_nowait(item)


def _drain(get: Callable[[], object]) -> None:
    """Read a generation's items up to its _END: its sessions are closed by then."""
    try:
        while get() is not _END:
            pass
    except queue.Empty:
        log.warning("a generation's sessions did not close within %.0f s", _CLOSE_WAIT_S)


async def _adrain(items: asyncio.Queue) -> None:
    while await items.get() is not _END:
        pass


def _check_gamma(value: int | str) -> int | str:
    if value != AUTO and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"num_speculative_tokens must be an integer >= 0 or {AUTO!r}, got {value!r}")
    return value


def _check_decode_steps(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DECODE_STEPS:
        raise ValueError(f"decode_steps must be an integer in [1, {MAX_DECODE_STEPS}], got {value!r}")
    return value


def _check_fanout(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"fanout must be an integer >= 0, got {value!r}")
    return value


def _logprobs_from_pb(token_ids: Sequence[int], entries: Sequence[pb.TokenLogprobs]) -> list[dict]:
    """One entry per token: its logprob, rank and top-N {token id: logprob}."""
    return [{"token_id": tok, "logprob": lp.logprob, "rank": lp.rank,
             "top_logprobs": dict(zip(lp.top_token_ids, lp.top_logprobs))}
            for tok, lp in zip(token_ids, entries)]


def _note_server(link: _Link, lost_from: Server | None, addresses: list[str]) -> int:
    """Record the server of link's new session in `addresses`; 1 if the session moved there
    from the server of a lost one (a failover), else 0."""
    if not addresses or addresses[-1] != link.server.address:
        addresses.append(link.server.address)
    link.lost_from = None
    return int(lost_from is not None and lost_from is not link.server)


def _check_kv(role: str, reported: int, expected: int) -> None:
    if reported != expected:
        raise RuntimeError(f"{role} reports KV length {reported}, the client expected {expected}")


def check_compatible(drafter: ModelInfo, verifier: ModelInfo) -> None:
    """Refuse a pair whose token ids would not mean the same text."""
    if drafter.tokenizer_fingerprint != verifier.tokenizer_fingerprint:
        raise IncompatibleModels(
            f"drafter {drafter.model} and verifier {verifier.model} use different tokenizers "
            f"(fingerprints {drafter.tokenizer_fingerprint[:12]} vs {verifier.tokenizer_fingerprint[:12]}); "
            "speculative decoding needs one vocabulary"
        )
    # One tokenizer, LM heads padded to different sizes (Qwen2.5: 151,936 rows up to 3B, 152,064
    # from 7B): ids past the tokenizer are padding rows. A smaller drafter head only never
    # proposes the ids past it (the verifier pads its proposals with zeros: exact); a larger one
    # could draft ids the verifier cannot score.
    if drafter.vocab_size > verifier.vocab_size:
        raise IncompatibleModels(
            f"drafter vocab_size {drafter.vocab_size} is larger than verifier vocab_size {verifier.vocab_size}: it "
            "could draft ids the verifier has no logits for"
        )


def _check_same_target(info: ModelInfo, ref: ModelInfo) -> None:
    """Verifiers of one pool serve one target: a generation that moves between them keeps
    sampling from the same distribution."""
    got = (info.model, info.vocab_size, info.tokenizer_fingerprint)
    want = (ref.model, ref.vocab_size, ref.tokenizer_fingerprint)
    if got != want:
        raise IncompatibleModels(
            f"verifier serves {info.model} (vocab {info.vocab_size}, tokenizer {info.tokenizer_fingerprint[:12]}), "
            f"its pool serves {ref.model} (vocab {ref.vocab_size}, tokenizer {ref.tokenizer_fingerprint[:12]})"
        )


def shares_device(drafter: ModelInfo | None, verifier: ModelInfo) -> bool:
    """Whether the two engines compute on one device, so that a drafter's work beside the
    verifier's only takes turns with it: both on CPUs (usually one host's cores), or both on
    the GPU of one UUID. Two CUDA processes on one GPU time-slice it: on an H200 a drafter
    prefilling beside the verifier's first round made the first token 75 ms against 13."""
    if drafter is None:
        return False
    if drafter.device.startswith("cpu") and verifier.device.startswith("cpu"):
        return True
    return bool(drafter.device_uuid) and drafter.device_uuid == verifier.device_uuid


def shared_gpu_cap(drafter: ModelInfo | None, verifier: ModelInfo) -> int:
    """ServingCosts.shared_gpu_cap for this pair: SHARED_GPU_DISABLE_BY_BATCH_SIZE when both
    engines time-slice one GPU; 0 on separate devices, and on CPUs (the verifier's own cap)."""
    on_gpu = shares_device(drafter, verifier) and not verifier.device.startswith("cpu")
    return SHARED_GPU_DISABLE_BY_BATCH_SIZE if on_gpu else 0


def _smallest_limits(info: ModelInfo, infos: Sequence[ModelInfo]) -> ModelInfo:
    """`info` with the smallest max_context, max_draft_tokens and vocab_size of its pool: what
    any of them takes."""
    return replace(info, max_context=min(i.max_context for i in infos),
                   max_draft_tokens=min(i.max_draft_tokens for i in infos),
                   vocab_size=min(i.vocab_size for i in infos))
