"""Run the gateway under uvicorn on a socket bound here, so that port 0 works (tests, the
local launcher) and the line `gateway listening on HOST:PORT` names the port bound."""

from __future__ import annotations

import asyncio
import socket
import ssl

import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.upstream import Upstream
from specdec_rpc.ops import freeze_heap


STREAM_END_MARGIN_S = 0.5  # streams still open this long before the grace ends get an error event


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, announce: str, end_streams) -> None:
        super().__init__(config)
        self._announce = announce
        self._end_streams = end_streams

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # accepting connections now (the lifespan started the upstream connection)
            print(self._announce, flush=True)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's: stop accepting, let requests finish for the grace, cancel the rest. A
        stream cancelled there ends mid-body (the client sees a broken chunked response), so
        the streams still open just before the grace ends get an error event and [DONE]."""
        grace = self.config.timeout_graceful_shutdown or 0.0
        timer = asyncio.get_running_loop().call_later(
            max(0.0, grace - STREAM_END_MARGIN_S), self._end_streams,
            f"the gateway is shutting down: the request was ended after the {grace:g} s grace; retry it")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000, *, grace_s: float = 5.0,
          ssl_certfile: str | None = None, ssl_keyfile: str | None = None, log_level: str = "info",
          upstream: Upstream | None = None) -> None:
    """Serve until SIGINT / SIGTERM; then stop accepting, let requests in flight finish for
    up to grace_s, cancel the rest (closing their upstream sessions) and exit. `upstream`:
    another client behind the app (default: a SpeculativeClient from config.upstream)."""
    if ssl_certfile or ssl_keyfile:  # uvicorn would load them only after binding, naming neither file
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(ssl_certfile, ssl_keyfile)
        except (OSError, ssl.SSLError, TypeError) as exc:
            raise ValueError(f"--ssl-certfile {ssl_certfile!r} / --ssl-keyfile {ssl_keyfile!r}: "
                             f"not a usable certificate and key ({exc})") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, as getaddrinfo would give: asyncio sets TCP_NODELAY on accepted connections
    # only for such sockets, and without it Nagle holds each response body back for the client's
    # delayed ACK (~40 ms per request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    app = create_app(config, upstream)
    freeze_heap("gateway")  # this process serves from here on (see freeze_heap)
    uv_config = uvicorn.Config(app, log_level=log_level.lower(),
                               timeout_graceful_shutdown=grace_s,
                               ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, access_log=False,
                               log_config=None)  # uvicorn logs through the root logger: one format
    scheme = "https" if ssl_certfile else "http"
    names = ",".join(config.served_model_names) or "(the verifier's)"
    announce = (f"gateway listening on {host}:{bound} url={scheme}://{host}:{bound}/v1 "
                f"verifier={config.upstream.verifier} "
                f"drafter={config.upstream.drafter} model={names} auth={config.api_key is not None}")
    _Server(uv_config, announce, app.state.gateway.end_streams).run(sockets=[sock])
