"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models,
plus /tokenize, /detokenize, /health (and /ping), /metrics and /version (as vLLM's server), over one
`Upstream` (the speculative client).

A request is validated (pydantic, then SamplingParams), tokenized, and started as tasks that
read the client's chunks, a generation per choice (n per prompt); the handler waits for every choice's first
round before it answers, so a verifier that is down is a 503 rather than a 200 stream with
an error in it. After that a stream sends one SSE event per round that produced text, the
choices' events interleaved as they arrive. Whichever way the client leaves (a closed
stream, a dropped non-streamed request) the generations are cancelled and their upstream
sessions are closed after the round in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.speculative import GenerationResult, StreamChunk
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.protocol import (
    CHAT,
    COMPLETIONS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    MAX_CHOICES,
    ResponseBuilder,
    TokenizeRequest,
    bad_request,
    choice_params,
    models_list,
    sampling_params,
)
from gateway.upstream import Generation, Upstream, UpstreamConfig

log = logging.getLogger("specdec.gateway")

CLIENT_CLOSED = 499  # nginx's code for a request the client abandoned; only metrics and logs see it
_ENDPOINTS = (COMPLETIONS, CHAT, "/v1/models", "/tokenize", "/detokenize", "/health", "/ping", "/metrics", "/version")
_KEYED = ("/v1", "/tokenize", "/detokenize")  # paths that need the API key (vLLM keys /v1 only)
# A 128k-token prompt is ~0.5 MB of text and ~1 MB as token ids, a 65,536-entry logit_bias ~1 MB:
# 32 MiB leaves room for a batch of long prompts and refuses what would only cost memory.
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
try:
    _VERSION = _package_version("specdec")
except PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"


@dataclass(frozen=True)
class CORS:
    """Cross-origin requests from browser pages (vLLM's --allowed-origins, ... and defaults)."""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class GatewayConfig:
    upstream: UpstreamConfig
    api_key: str | None = None  # clients must send `Authorization: Bearer <api_key>` to /v1/*
    served_model_names: tuple[str, ...] = ()  # default: the verifier's model name
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413; 0: no limit
    cors: CORS = CORS()


class _ClientGone(Exception):
    pass


class _Closing(Exception):
    pass


class Gateway:
    """What the routes share: the upstream, the metrics, and the open streams a shutdown ends.
    One per app (`app.state.gateway`, as vLLM keeps its engine client in `app.state`)."""

    def __init__(self, config: GatewayConfig, upstream: Upstream) -> None:
        self.config, self.upstream = config, upstream
        self.metrics = GatewayMetrics()
        self.started = int(time.time())
        self.streams: set[asyncio.Queue] = set()  # the arrival queues of the open streams (_sse)
        self.closing = asyncio.Event()  # set with `ending` just before a shutdown's grace runs out
        self.ending: list[APIError] = []

    def end_streams(self, message: str) -> int:
        """End every open stream with an error event (then `data: [DONE]`), and answer every
        other request still running 503, just before a shutdown's grace runs out: the server
        would otherwise cut the streams mid-body and answer the rest with a plain-text 500."""
        error = APIError(503, message, type="service_unavailable", code="shutting_down")
        self.ending.append(error)
        self.closing.set()
        for arrived in list(self.streams):
            arrived.put_nowait((0, error))
        return len(self.streams)

    def served_names(self) -> tuple[str, ...]:
        """--served-model-name, else the verifier's model name without its runtime tag
        ("[float32+onednn]"), so the id clients send survives a restart with other dtype or kernel
        flags."""
        if self.config.served_model_names:
            return self.config.served_model_names
        model = self.upstream.require().verifier_info.model
        return (re.sub(r"\[[^\]]*\]$", "", model) or model,)

    def check_model(self, model: str | None) -> str:
        names = self.served_names()
        if model and model not in names:  # "" or None: the first name
            # Without --served-model-name the verifier's tagged name (the id before) answers too.
            tagged = not self.config.served_model_names and model == self.upstream.require().verifier_info.model
            if not tagged:
                raise APIError(404, f"The model `{model}` does not exist; this server serves {', '.join(names)}.",
                               param="model", code="model_not_found")
        # Any served name answers, and is answered and counted as the first (vLLM's rule): one
        # label for a dashboard, whichever alias its clients send.
        return names[0]

    async def generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Response:
        upstream, metrics = self.upstream, self.metrics
        endpoint = CHAT if chat else COMPLETIONS
        body.refuse_unsupported()
        try:  # arriving while the gateway still connects upstream: wait for it, bounded (then 503)
            client = await _race(request, upstream.wait_ready())
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        model = self.check_model(body.model)
        n = body.n or 1
        raw_prompts = [None] if chat else body.prompts()
        # Counted before any prompt is tokenized (3,000 long prompts took 11 s to refuse); the
        # field to shrink is n where it asks for more than one, else the prompt batch.
        field = "n" if n > 1 else "prompt"
        if len(raw_prompts) * n > MAX_CHOICES:
            raise bad_request(field, f"prompts x n = {len(raw_prompts)} x {n} is more than {MAX_CHOICES} generations "
                                     "in one request")
        slots = self.config.upstream.max_concurrent_requests
        if len(raw_prompts) * n > slots:  # its last choices would wait for its first ones' slots, then 503
            raise bad_request(field, f"prompts x n = {len(raw_prompts)} x {n} generations is more than this gateway "
                                     f"runs at once (--max-concurrent-requests {slots})")
        if chat:
            prompts = [await upstream.encode(messages=body.template_messages(),
                                             template_options=body.template_options())]
        else:
            # token ids are checked against the verifier's vocabulary there (SpeculativeClient.encode_prompt)
            prompts = [await upstream.encode(prompt=p, add_special_tokens=body.add_special_tokens)
                       for p in raw_prompts]
        max_context, vocab_size = client.verifier_info.max_context, client.verifier_info.vocab_size
        # Choice i is prompt i // n's (vLLM's numbering); its timer counts the prompt's tokens once.
        choices = [(ids, params, j == 0) for ids in prompts
                   for j, params in enumerate(choice_params(sampling_params(body, len(ids), max_context, vocab_size),
                                                            n))]
        echo = not chat and body.echo
        # The echoed text is the prompt as sent (token ids: their text), as vLLM's.
        echo_texts = [p if isinstance(p, str) else client.tokenizer.decode(p) for p in raw_prompts] if echo else []
        # The caller's id names the response (vLLM's: the X-Request-Id header, else the body's
        # request_id), so its logs and ours can be joined; the header comes back as it came.
        request_id = request.headers.get("x-request-id") or body.request_id
        headers = {"X-Request-Id": request.headers["x-request-id"]} if "x-request-id" in request.headers else {}
        builder = ResponseBuilder(chat=chat, model=model, prompt_tokens=sum(map(len, prompts)),
                                  id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}" if request_id else "",
                                  decode=upstream.decode_token, token_bytes=upstream.token_bytes,
                                  logprobs=choices[0][1].logprobs is not None,
                                  include_usage=bool(body.stream_options and body.stream_options.include_usage),
                                  continuous_usage=bool(body.stream_options and body.stream_options.include_usage
                                                        and body.stream_options.continuous_usage_stats),
                                  choice_prompts=[ids for ids, _, _ in choices],
                                  num_choices=len(choices), echo=echo, echo_only=echo and body.echo_only,
                                  echo_texts=[echo_texts[i // n] for i in range(len(choices))] if echo else [],
                                  prompt_logprobs=choices[0][1].prompt_logprobs is not None)
        runs: list[_Choice] = []
        try:
            for ids, params, first in choices:  # inside the try: a later start's failure cancels the earlier ones
                runs.append(_Choice(upstream.start(ids, params), metrics.timer(model, endpoint), len(ids) if first else 0))
            # Every choice's first round before the answer: a verifier that is down is a 503,
            # not a 200 stream with an error in it.
            firsts = await _race(request, asyncio.gather(*(_next(r.gen, r.timer) for r in runs)), self.closing)
            if any(first is None for first in firsts):
                raise APIError(500, "the generation ended without a result", type="server_error")
            if body.stream:
                # The background task runs once the stream ends, also when Starlette cancels it
                # because the client left: the generations stop even before _sse is finalized.
                return StreamingResponse(_sse(runs, firsts, builder, self.streams), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
                                         background=BackgroundTask(_cancel, runs))
            results = await _race(request, asyncio.gather(*(_rest(r.gen, f, r.timer) for r, f in zip(runs, firsts))),
                                  self.closing)
        except _ClientGone:
            _cancel(runs)
            _finish(runs, builder, None, "abort")
            return Response(status_code=CLIENT_CLOSED)
        except _Closing:
            _cancel(runs)
            _finish(runs, builder, None, "abort")
            raise self.ending[0] from None
        except BaseException as exc:
            _cancel(runs)
            if runs:
                # A request the services refused (a 4xx) is no served request, as one the gateway refused.
                refused = isinstance(exc, APIError) and 400 <= exc.status < 500
                _finish(runs, builder, None, "abort" if isinstance(exc, asyncio.CancelledError) else
                        "refused" if refused else "error", count=not refused)
            raise
        _finish(runs, builder, results)
        return JSONResponse(builder.response(results), headers=headers)


def create_app(config: GatewayConfig, upstream: Upstream | None = None) -> FastAPI:
    gateway = Gateway(config, upstream or Upstream(config.upstream))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        connecting = asyncio.create_task(gateway.upstream.connect_forever())
        try:
            yield
        finally:
            connecting.cancel()
            gateway.upstream.stop_connecting()
            await gateway.upstream.close()

    app = FastAPI(title="specdec OpenAI-compatible gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.include_router(router)
    for exc_class, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    app.add_middleware(_FrontDoor, api_key=config.api_key, metrics=gateway.metrics,
                       max_request_bytes=config.max_request_bytes)
    # Outermost (added last): it answers a browser's preflight itself and puts its headers on every
    # answer, the 401s and 413s of the front door included, so a page can read why it was refused.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.cors.allowed_origins),
                       allow_methods=list(config.cors.allowed_methods),
                       allow_headers=list(config.cors.allowed_headers),
                       allow_credentials=config.cors.allow_credentials)
    return app


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


# ---- errors in OpenAI's shape -------------------------------------------------------------------


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_to_api_error(exc)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    err = APIError(exc.status_code, str(exc.detail), code=code)
    if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
        # FastAPI's "error parsing the body": bytes that are not UTF-8, nesting past Python's
        # recursion limit, an integer past its 4,300 digits. Its cause says which.
        err = bad_request(None, f"malformed JSON body: {str(exc.__cause__)[:200]}", code="invalid_json")
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    err = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


_ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _validation_error,
                   StarletteHTTPException: _http_error, Exception: _internal_error}


# ---- routes -------------------------------------------------------------------------------------

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and curl -I's probe
@router.api_route("/ping", methods=["GET", "POST"])  # vLLM's alias (SageMaker's probe)
async def health(request: Request) -> JSONResponse:
    ok, detail = await _gateway(request).upstream.health()
    return JSONResponse(detail, status_code=200 if ok else 503)


@router.get("/version")
async def version() -> dict:
    return {"version": _VERSION}


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    gw = _gateway(request)
    if gw.upstream.client is not None or gw.config.served_model_names:  # the model's name is known
        name = gw.served_names()[0]
        gw.metrics.running.labels(name).set(gw.upstream.running())
        gw.metrics.waiting.labels(name).set(gw.upstream.waiting())
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    gw = _gateway(request)
    client = await gw.upstream.wait_ready()  # like a completion, while the gateway still connects
    info = client.verifier_info
    return models_list(list(gw.served_names()), info.model, info.max_context, gw.started)


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    """OpenAI's models.retrieve: one served name's card; another name is 404 model_not_found."""
    gw = _gateway(request)
    client = await gw.upstream.wait_ready()
    info = client.verifier_info
    name = gw.check_model(model)  # the verifier's own tagged id answers as the served name, as in a completion
    if model in gw.served_names():  # an alias has a card of its own, as in /v1/models
        name = model
    return models_list([name], info.model, info.max_context, gw.started)["data"][0]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """vLLM's: the ids a completion (prompt) or chat (messages) request would send."""
    gw = _gateway(request)
    parsed = body.as_request()
    client = await gw.upstream.wait_ready()
    gw.check_model(parsed.model)
    if isinstance(parsed, ChatCompletionRequest):
        ids = await gw.upstream.encode(messages=parsed.template_messages(), template_options=parsed.template_options())
    else:
        ids = await gw.upstream.encode(prompt=parsed.prompt, add_special_tokens=parsed.add_special_tokens)
    out = {"count": len(ids), "max_model_len": client.verifier_info.max_context, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = client.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    gw = _gateway(request)
    client = await gw.upstream.wait_ready()
    gw.check_model(body.model)
    try:
        client.check_vocab(body.tokens, "tokens")
    except ValueError as exc:
        raise bad_request("tokens", str(exc)) from None
    return {"prompt": client.tokenizer.decode(body.tokens)}


@router.post(COMPLETIONS)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _gateway(request).generate(request, body, chat=False)


@router.post(CHAT)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _gateway(request).generate(request, body, chat=True)


def validation_to_api_error(exc: RequestValidationError) -> APIError:
    """pydantic's first error as a 400 naming the field, e.g. `messages[0].role`; a body
    that is not JSON at all names no field."""
    err = exc.errors()[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return bad_request(None, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    if not loc:  # the body itself: empty, a JSON array, or sent without Content-Type: application/json
        return bad_request(None, f"the request body must be a JSON object, sent with Content-Type: application/json "
                                 f"({err.get('msg')})", code="invalid_json")
    param = None
    for part in loc:
        if isinstance(part, int):
            param = f"{param}[{part}]"
        elif part.isidentifier() and part not in _TYPE_NAMES:
            param = part if param is None else f"{param}.{part}"
        else:
            break  # pydantic names the union arm it tried (`str`, `list[int]`): the field ends here
    message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return bad_request(param, message)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "function-after"})


@dataclass
class _Choice:
    """One choice of a request: its generation, its timer, and the prompt tokens it counts."""

    gen: Generation
    timer: RequestTimer
    prompt_tokens: int


def _cancel(runs: list[_Choice]) -> None:
    for run in runs:
        run.gen.cancel()


async def _next(gen: Generation, timer: RequestTimer) -> StreamChunk | None:
    chunk = await gen.next()
    if chunk is not None:
        timer.chunk(len(chunk.token_ids))
    return chunk


async def _rest(gen: Generation, chunk: StreamChunk, timer: RequestTimer) -> GenerationResult:
    while chunk.result is None:
        chunk = await _next(gen, timer)
        if chunk is None:
            raise APIError(500, "the generation ended without a result", type="server_error")
    return chunk.result


async def _race(request: Request, awaitable, closing: asyncio.Event | None = None) -> object:
    """`awaitable`'s result, or _ClientGone as soon as the HTTP client disconnects (_Closing
    once `closing` is set: the gateway is shutting down)."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    shut = asyncio.ensure_future(closing.wait()) if closing is not None else None
    try:
        done, _ = await asyncio.wait({task, watch} | ({shut} if shut else set()), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _abandon(task)
        raise
    finally:
        watch.cancel()
        if shut is not None:
            shut.cancel()
    if task in done:
        return task.result()
    _abandon(task)
    raise _Closing if shut in done else _ClientGone


def _abandon(task: asyncio.Future) -> None:
    """Cancel `task`, whose outcome nobody will read: a cancelled gather() ends with an
    exception that asyncio would otherwise log as never retrieved."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(runs: list[_Choice], firsts: list[StreamChunk], builder: ResponseBuilder,
               streams: set[asyncio.Queue]) -> AsyncIterator[str]:
    """One `data: {json}` event per body, then `data: [DONE]`; the choices' chunks go out in
    the order their rounds arrive. A disconnect cancels this generator at its await
    (Starlette watches the connection), which cancels the generations. `streams` holds
    its arrival queue while it runs: an APIError put there ends it (Gateway.end_streams)."""
    arrived: asyncio.Queue = asyncio.Queue()
    streams.add(arrived)

    async def pump(index: int) -> None:
        run, chunk = runs[index], firsts[index]
        try:
            while chunk is not None:
                arrived.put_nowait((index, chunk))
                chunk = await _next(run.gen, run.timer) if chunk.result is None else None
        except APIError as exc:
            arrived.put_nowait((index, exc))

    results: list[GenerationResult | None] = [None] * len(runs)
    reason = "abort"
    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(runs))]
    try:
        for body in builder.start():
            yield _event(body)
        while any(r is None for r in results):
            index, item = await arrived.get()
            if isinstance(item, APIError):  # after the 200: the error travels in the stream, as vLLM does
                reason = "error"
                log.warning("stream id=%s failed: %s", builder.id, item.message)
                yield _event(item.body())
                break
            for body in builder.chunks(item, index):
                yield _event(body)
            results[index] = item.result or results[index]
        else:
            for body in builder.end(results):
                yield _event(body)
    finally:
        streams.discard(arrived)
        for task in pumps:
            task.cancel()
        _cancel(runs)
        _finish(runs, builder, results if all(r is not None for r in results) else None, reason)
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _finish(runs: list[_Choice], builder: ResponseBuilder, results: list[GenerationResult] | None,
            reason: str | None = None, count: bool = True) -> None:
    """Metrics per choice (a generation each, unless not `count`), one log line per request."""
    for i, run in enumerate(runs):
        if count:
            run.timer.finish(run.prompt_tokens, results[i] if results is not None else None, reason,
                             scored_only=builder.echo_only, scheduled=run.gen.scheduled)
    start, tokens = runs[0].timer.start, 0 if builder.echo_only else sum(run.timer.tokens for run in runs)
    if results is None:
        log.info("request id=%s endpoint=%s choices=%d prompt_tokens=%d completion_tokens=%d finish=%s ms=%.0f",
                 builder.id, runs[0].timer.endpoint, len(runs), builder.prompt_tokens, tokens, reason,
                 1000 * (time.perf_counter() - start))
    else:
        log.info("request id=%s endpoint=%s choices=%d prompt_tokens=%d completion_tokens=%d finish=%s ms=%.0f "
                 "rounds=%d drafts=%d accepted=%d", builder.id, runs[0].timer.endpoint, len(runs),
                 builder.prompt_tokens, 0 if builder.echo_only else sum(len(r.token_ids) for r in results),
                 ",".join(r.finish_reason for r in results), 1000 * (time.perf_counter() - start),
                 sum(r.num_rounds for r in results), sum(r.num_draft_tokens for r in results),
                 sum(r.num_accepted_tokens for r in results))


class _FrontDoor:
    """Pure ASGI (a BaseHTTPMiddleware would buffer streams and hide disconnects): checks the
    API key of /v1/* before the body is read, refuses a body past `max_request_bytes` (413)
    before it is all read, and counts every answer by endpoint and status."""

    def __init__(self, app, api_key: str | None, metrics: GatewayMetrics, max_request_bytes: int = 0) -> None:
        self.app, self.metrics, self.max_request_bytes = app, metrics, max_request_bytes
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        status = {"code": 500}

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if (self._key_digest is not None and path.startswith(_KEYED) and scope["method"] != "OPTIONS"
                    and not self._authorized(scope)):  # a browser's preflight carries no key (as vLLM's check)
                err = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                               code="invalid_api_key")
                response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, counting_send)
                return
            if self.max_request_bytes and scope["method"] in ("POST", "PUT", "PATCH"):
                bounded = await self._bounded_body(scope, receive)
                if bounded is None:
                    err = APIError(413, f"The request body is larger than {self.max_request_bytes} bytes "
                                        f"(the gateway's --max-request-bytes).", code="request_too_large")
                    # Connection: close, since the rest of the body is not read.
                    await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(
                        scope, receive, counting_send)
                    return
                receive = bounded
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    async def _bounded_body(self, scope, receive):
        """The body read up to the limit and handed to the app as one message (it reads it
        whole anyway), then `receive` itself for the disconnect; None past the limit. A
        declared Content-Length past it is refused before a byte is read; a chunked body or
        one that exceeds what it declared is counted as it arrives."""
        for key, value in scope.get("headers", ()):
            if key == b"content-length" and value.strip().isdigit() and int(value) > self.max_request_bytes:
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it at its first read
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return first
            return await receive()
        return replay

    def _authorized(self, scope) -> bool:
        given = b""
        for key, value in scope.get("headers", ()):
            if key == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        # Constant time over fixed-length digests: neither the key nor its length leaks.
        return hmac.compare_digest(hashlib.sha256(given).digest(), self._key_digest)
