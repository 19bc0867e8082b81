"""Stand-ins for vLLM's HTTP surface behind `handoff proxy`, reporting as real SDK engines.

NOT vLLM. Each stand-in serves the two P/D legs the proxy sends (the
prefill: ``max_tokens 1`` with ``do_remote_decode``, answering
``kv_transfer_params``; the decode: the prompt with those params, answering
or streaming tokens) and reports to a real coordinator through a real
EngineSidecar what HandoffConnector reports in a real vLLM: SourceHeld once
the prefill request arrived, DestinationReserved once the decode request
arrived, TransferCompleted for the pull, and the decode answers only after
ActivateDestination. Like vLLM, a stand-in's request handler is canceled when
the proxy closes the leg's connection, and the stand-in records it. The
tests against real vLLM engines are in `make test-vllm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from handoff_client import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    Completion,
    DestinationEngine,
    EngineSidecar,
    Facts,
    HandoffClient,
    Outcome,
    SourceEngine,
    TimingMode,
    TransferTiming,
)
from handoff_proxy.app import Proxy
from handoff_proxy.config import EngineAddress, ProxyConfig
from tests.sidecar_support import QUICK

TIMEOUT_S = 10.0
ANSWER = ("Tokens", " decoded", " after", " {source}")  # the decode's answer, token by token


async def serve_app(app: web.Application) -> tuple[web.AppRunner, int]:
    """``app`` on a free loopback port; handlers canceled when their client disconnects."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server: Any = site._server
    port: int = server.sockets[0].getsockname()[1]
    return runner, port


class StandIn:
    """What both stand-ins share: the HTTP server, the sidecar, the records."""

    role = ""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []
        self.authorizations: list[str | None] = []
        self.arrived: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.arrivals: asyncio.Queue[str] = asyncio.Queue()  # each leg's handoff id, as it came
        self.closed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)  # leg cut off
        self.freed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.completions: defaultdict[str, asyncio.Queue[Completion | None]] = defaultdict(
            asyncio.Queue
        )
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.sidecar: EngineSidecar | None = None
        self._client: HandoffClient | None = None

    def address(self) -> EngineAddress:
        return EngineAddress(self.engine_id, self.url)

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, client: HandoffClient | None) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._leg)
        app.router.add_post("/v1/chat/completions", self._leg)
        self._runner, port = await serve_app(app)
        self.url = f"http://127.0.0.1:{port}"
        self._client = client
        if client is not None:
            self.sidecar = EngineSidecar(
                client, self.engine_id, self.handlers(), reconnect_backoff=QUICK
            )
            await self.sidecar.__aenter__()
            async with asyncio.timeout(TIMEOUT_S):
                await self.sidecar.wait_subscribed()

    def handlers(self) -> SourceEngine | DestinationEngine:
        raise NotImplementedError

    async def restart_sidecar(self) -> None:
        """A new incarnation, as after the engine restarted: the old one's memory is lost."""
        client = self._client
        assert self.sidecar is not None
        assert client is not None
        await self.sidecar.__aexit__(None, None, None)
        self.sidecar = EngineSidecar(
            client, self.engine_id, self.handlers(), reconnect_backoff=QUICK
        )
        await self.sidecar.__aenter__()
        async with asyncio.timeout(TIMEOUT_S):
            await self.sidecar.wait_subscribed()

    async def stop(self) -> None:
        if self.sidecar is not None:
            await self.sidecar.__aexit__(None, None, None)
        if self._runner is not None:
            await self._runner.cleanup()
        for task in list(self._tasks):
            task.cancel()

    async def complete(self, action: Action) -> None:
        self.completions[action.handoff_id].put_nowait(action.completion)

    async def ended(self, handoff_id: str, completion: Completion) -> None:
        """Until this engine was told the handoff completed ``completion``."""
        while await self.completions[handoff_id].get() is not completion:
            pass

    async def _leg(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        self.authorizations.append(request.headers.get("Authorization"))
        params = body.get("kv_transfer_params") or {}
        key = params.get("handoff_id") or request.headers.get("X-Request-Id") or ""
        try:
            self.arrived[key].set()
            self.arrivals.put_nowait(key)
            return await self.answer(request, body, params, key)
        except asyncio.CancelledError:
            self.closed[key].set()
            raise

    async def answer(
        self, request: web.Request, body: dict[str, Any], params: dict[str, Any], key: str
    ) -> web.StreamResponse:
        raise NotImplementedError


class StandInPrefill(StandIn):
    """A prefill vLLM's HTTP leg and its connector's reports (a stand-in, not vLLM)."""

    role = "prefill"

    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id)
        self.held: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.fail_status: int | None = None  # answer the leg with this HTTP status
        self.hang = False  # never answer the leg (until its connection closes)

    def handlers(self) -> SourceEngine:
        return self

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        self.later(self._hold(action.handoff_id, facts))
        return SUBMITTED

    async def _hold(self, handoff_id: str, facts: Facts) -> None:
        await self.arrived[handoff_id].wait()  # the prompt is here: compute, hold
        timing = TransferTiming(TimingMode.FULL_PROMPT, 16, 4096, 10.0)
        await facts.source_held(handoff_id, timing)
        self.held[handoff_id].set()

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return self._free(action.handoff_id)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return self._free(action.handoff_id)

    def _free(self, handoff_id: str) -> Outcome:
        if self.freed[handoff_id].is_set():
            return NOOP
        self.freed[handoff_id].set()
        return APPLIED

    async def answer(
        self, request: web.Request, body: dict[str, Any], params: dict[str, Any], key: str
    ) -> web.StreamResponse:
        if self.fail_status is not None:
            error = {"error": {"message": "stand-in prefill: out of KV blocks", "code": 500}}
            return web.json_response(error, status=self.fail_status)
        if self.hang:
            await asyncio.Event().wait()
        if params.get("handoff_id"):
            await self.held[key].wait()  # as HandoffConnector: answers once it holds
        answered: dict[str, Any] = {
            "id": f"cmpl-{key}",
            "choices": [{"index": 0, "text": "T", "finish_reason": "length"}],
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_block_ids": [0, 1],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
            },
        }
        return web.json_response(answered)


class StandInDecode(StandIn):
    """A decode vLLM's HTTP leg and its connector's reports (a stand-in, not vLLM)."""

    role = "decode"

    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id)
        self.activated: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.streaming: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.hold = False  # never report DestinationReserved (the handoff waits)
        self.stall = False  # after the first token, wait until the leg is closed
        # After the first token, once told to, drop the connection (a crash).
        self.break_off = False
        self.proceed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def handlers(self) -> DestinationEngine:
        return self

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        self.later(self._reserve(action.handoff_id, facts))
        return ACCEPTED

    async def _reserve(self, handoff_id: str, facts: Facts) -> None:
        await self.arrived[handoff_id].wait()
        if not self.hold:
            await facts.destination_reserved(handoff_id, 16)

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        self.later(facts.transfer_completed(action.handoff_id))  # the pull, done at once
        return SCHEDULED

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        self.activated[action.handoff_id].set()
        return APPLIED

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        if self.freed[action.handoff_id].is_set():
            return NOOP
        self.freed[action.handoff_id].set()
        return APPLIED

    async def answer(
        self, request: web.Request, body: dict[str, Any], params: dict[str, Any], key: str
    ) -> web.StreamResponse:
        if params.get("handoff_id"):
            await self.activated[key].wait()  # as HandoffConnector: not before activation
        chat = request.path.endswith("/chat/completions")
        tokens = [token.format(source=params.get("remote_engine_id")) for token in ANSWER]
        if not body.get("stream"):
            text = "".join(tokens)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            return web.json_response({"id": f"cmpl-{key}", "choices": [choice]})
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for index, token in enumerate(tokens):
            delta: dict[str, Any] = (
                {"index": 0, "delta": {"content": token}} if chat else {"index": 0, "text": token}
            )
            await stream.write(f"data: {json.dumps({'choices': [delta]})}\n\n".encode())
            if index == 0 and self.break_off:
                await self.proceed[key].wait()
                assert request.transport is not None
                request.transport.abort()
                return stream
            if index == 0 and self.stall:
                self.streaming[key].set()
                await asyncio.Event().wait()
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream


@dataclass
class Rig:
    """A coordinator, stand-in engines with their sidecars, and a proxy in front."""

    client: HandoffClient | None  # the tests' own view of the coordinator
    prefills: list[StandInPrefill]
    decodes: list[StandInDecode]
    proxy: Proxy
    url: str


@contextlib.asynccontextmanager
async def standins(
    client: HandoffClient | None, prefills: int = 1, decodes: int = 1
) -> AsyncIterator[tuple[list[StandInPrefill], list[StandInDecode]]]:
    """Stand-in engines on free ports, reporting through ``client`` (None: no sidecars)."""
    prefill = [StandInPrefill(f"prefill-{n}") for n in range(prefills)]
    decode = [StandInDecode(f"decode-{n}") for n in range(decodes)]
    engines: list[StandIn] = [*prefill, *decode]
    try:
        for engine in engines:
            await engine.start(client)
        yield prefill, decode
    finally:
        for engine in engines:
            await engine.stop()


@contextlib.asynccontextmanager
async def rig(
    coordinator: str | None,
    *,
    prefills: int = 1,
    decodes: int = 1,
    register: bool = True,
    **config: Any,
) -> AsyncIterator[Rig]:
    """Stand-ins (reporting to ``coordinator`` if ``register``) and a proxy on free ports."""
    client = None if coordinator is None else HandoffClient(coordinator, timeout_s=TIMEOUT_S)
    try:
        async with standins(client if register else None, prefills, decodes) as (prefill, decode):
            settings: dict[str, Any] = {
                "port": 0,
                "coordinator": coordinator or "127.0.0.1:1",
                "use_coordinator": coordinator is not None,
                "poll_interval_s": 0.05,
                "deadline_s": 10.0,
                "drain_grace_s": 0.5,
            } | config
            proxy = Proxy(
                ProxyConfig(
                    prefill=tuple(e.address() for e in prefill),
                    decode=tuple(e.address() for e in decode),
                    **settings,
                )
            )
            await proxy.start()
            try:
                yield Rig(client, prefill, decode, proxy, f"http://127.0.0.1:{proxy.port}")
            finally:
                await proxy.stop()
    finally:
        if client is not None:
            await client.close()


def sse_events(text: str) -> list[Any]:
    """The data of each server-sent event; ``[DONE]`` as the string."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events
