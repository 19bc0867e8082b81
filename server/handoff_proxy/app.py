"""The aiohttp application: the OpenAI routes, /health, /metrics, and its process.

The runner cancels a request's handler when its client disconnects
(``handler_cancellation``): that is how a disconnect reaches the flow, which
closes the open leg and cancels the handoff. A streamed answer's headers go
out once the decode answered 200, so an error in the prefill leg or in the
decode's start is a plain HTTP error; an error after that arrives as a last
SSE event ``data: {"error": ...}`` before the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from handoff_client import HandoffClient, RetryPolicy
from handoff_proxy.config import ProxyConfig
from handoff_proxy.errors import ProxyError
from handoff_proxy.flow import Background, ClientGone, Endpoint, Exchange, Services
from handoff_proxy.metrics import ProxyMetrics
from handoff_proxy.pairs import Pool

log = logging.getLogger("handoff.proxy")
KEEPALIVE_S = 2.0  # an idle connection to an engine, at most

CONFIG = web.AppKey("config", ProxyConfig)
SERVICES = web.AppKey("services", Services)
CODE = web.RequestKey("code", int)  # the status a request ended with, for its metrics
# A streamed answer that ended in an error event: its status for the metrics.
CODE_OVERRIDE = web.RequestKey("code_override", int)
GONE = 499  # nginx's "client closed request": the metrics' code for a disconnect
DRAIN_S = 5.0  # at shutdown, for the cancels of the requests cut off to be reported


def build(config: ProxyConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app.cleanup_ctx.append(_services)
    app.on_shutdown.append(_stopping)
    app.router.add_post(Endpoint.COMPLETIONS.value, _completions)
    app.router.add_post(Endpoint.CHAT.value, _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _services(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    client = None
    if config.use_coordinator:
        client = HandoffClient(
            config.coordinator,
            timeout_s=config.coordinator_timeout_s,
            retry=RetryPolicy(within_s=config.coordinator_retry_s),
            **config.security,
        )
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s),
        # The engines' own limits apply (limit=0). An idle connection is not kept
        # past KEEPALIVE_S: vLLM's server closes its idle ones after 5 s
        # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a leg sent on one it just closed
        # fails with "Server disconnected" (seen beside a CPU-bound process).
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
    )
    engines = [("prefill", e.engine_id) for e in config.prefill]
    engines += [("decode", e.engine_id) for e in config.decode]
    services = Services(
        config=config,
        pool=Pool(config.prefill, config.decode, config.max_in_flight),
        metrics=ProxyMetrics(engines),
        session=session,
        client=client,
        background=Background(),
    )
    app[SERVICES] = services
    yield
    await services.background.drain(DRAIN_S)
    await session.close()
    if client is not None:
        await client.close()


async def _stopping(app: web.Application) -> None:
    app[SERVICES].stopping = True


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.COMPLETIONS)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.CHAT)


def error_response(error: ProxyError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return web.json_response(error.body(), status=error.status, headers=headers)


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    services = request.app[SERVICES]
    metrics = services.metrics
    began = time.monotonic()
    metrics.in_flight.inc()
    request[CODE] = 500
    try:
        body = await _body(request)
        response = await _answer(request, services, endpoint, body, began)
        request[CODE] = request.get(CODE_OVERRIDE, response.status)
        return response
    except ProxyError as error:
        request[CODE] = error.status
        return error_response(error)
    except asyncio.CancelledError:
        request[CODE] = GONE
        raise
    except Exception as error:  # a bug of ours: still an OpenAI-style body, and logged
        log.exception("request failed in the proxy")
        request[CODE] = 500
        return error_response(ProxyError(500, f"handoff proxy: internal error: {error!r}"))
    finally:
        metrics.in_flight.dec()
        metrics.requests.labels(endpoint.label, str(request[CODE])).inc()
        metrics.duration.labels(endpoint.label).observe(time.monotonic() - began)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        raise ProxyError(
            413, f"request body over {request.app[CONFIG].max_body_bytes} bytes (--max-body-bytes)"
        ) from None
    except ValueError as error:
        raise ProxyError(400, f"request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
    return body


async def _answer(
    request: web.Request,
    services: Services,
    endpoint: Endpoint,
    body: dict[str, Any],
    began: float,
) -> web.StreamResponse:
    metrics = services.metrics

    def first() -> None:
        metrics.first_byte.labels(endpoint.label).observe(time.monotonic() - began)

    exchange = Exchange(
        services,
        endpoint,
        body,
        request.headers.get("X-Request-Id"),
        request.headers.get("Authorization"),
    )
    stream: web.StreamResponse | None = None
    try:
        async with exchange:
            await exchange.start()
            params = await exchange.prefill()
            decode = await exchange.open_decode(params)
            headers = {"X-Request-Id": exchange.request_id}
            content_type = decode.headers.get("Content-Type", "application/json")
            if not exchange.stream:
                data = await exchange.read_decode()
                first()
                return web.Response(body=data, headers={**headers, "Content-Type": content_type})
            stream = web.StreamResponse(
                headers={**headers, "Content-Type": content_type, "Cache-Control": "no-cache"}
            )
            try:
                await stream.prepare(request)
            except ConnectionError as error:
                raise ClientGone(str(error)) from error
            await exchange.relay(stream.write, first)
            with contextlib.suppress(ConnectionError):
                await stream.write_eof()
            return stream
    except ClientGone:
        assert stream is not None  # raised only once the answer was under way
        request[CODE_OVERRIDE] = GONE
        return stream
    except ProxyError as error:
        if stream is None or not stream.prepared:
            raise
        request[CODE_OVERRIDE] = error.status
        event = b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        with contextlib.suppress(ConnectionError):
            await stream.write(event)
            await stream.write_eof()
        return stream


async def _models(request: web.Request) -> web.Response:
    """The first decode engine's /v1/models, for clients that ask which model is served."""
    services = request.app[SERVICES]
    engine = services.pool.decode[0]
    try:
        async with services.session.get(engine.url + "/v1/models") as response:
            data = await response.read()
            return web.Response(
                body=data,
                status=response.status,
                headers={"Content-Type": response.headers.get("Content-Type", "application/json")},
            )
    except aiohttp.ClientError as error:
        return error_response(
            ProxyError(
                502,
                f"decode engine {engine.engine_id} ({engine.url}) could not be reached: {error!r}",
                engine_id=engine.engine_id,
            )
        )


async def _health(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    return web.json_response(
        {
            "status": "ok",
            "coordinator": config.coordinator if config.use_coordinator else None,
            "prefill": [engine.engine_id for engine in config.prefill],
            "decode": [engine.engine_id for engine in config.decode],
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    registry = request.app[SERVICES].metrics.registry
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


class Proxy:
    """The proxy on its port, in this event loop: :meth:`start`, then :meth:`stop`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.app = build(config)
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            # aiohttp reads 0 as "wait for ever": a moment is as good as none.
            shutdown_timeout=max(config.drain_grace_s, 0.001),
        )
        self.port = config.port
        self._stopped = False

    @property
    def services(self) -> Services:
        return self.app[SERVICES]

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the one bound, for --port 0
        mode = "under coordinator " + self.config.coordinator
        if not self.config.use_coordinator:
            mode = "without a coordinator (--no-coordinator)"
        log.info(
            "handoff proxy on http://%s:%d %s; prefill %s; decode %s",
            self.config.host,
            self.port,
            mode,
            ", ".join(f"{e.engine_id}={e.url}" for e in self.config.prefill),
            ", ".join(f"{e.engine_id}={e.url}" for e in self.config.decode),
        )

    async def stop(self) -> None:
        """Stop listening, give requests in flight ``--drain-grace-s``, cut off the rest."""
        if not self._stopped:
            self._stopped = True
            await self._runner.cleanup()


def run(config: ProxyConfig) -> int:
    from handoff_server.ops import logs

    logs.configure(config.log_format, config.log_level)
    try:
        asyncio.run(_serve_forever(config))
    except (OSError, ValueError) as error:  # a port taken, unreadable TLS material
        print(f"handoff proxy: {error}", file=sys.stderr)
        return 1
    return 0


async def _serve_forever(config: ProxyConfig) -> None:
    proxy = Proxy(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await proxy.start()
    try:
        await stop.wait()
    finally:
        log.info("handoff proxy stopping")
        await proxy.stop()
