"""One client request's handoff: start it, run the two legs, watch it, end it.

The legs are vLLM's own P/D exchange (its connector's conventions, fixed
with HandoffConnector):

- prefill: the client's body with ``max_tokens: 1`` (and
  ``max_completion_tokens`` for chat), ``stream: false`` and
  ``kv_transfer_params`` asking for a remote decode, carrying the handoff id;
- decode: the client's own body with the prefill's ``kv_transfer_params``,
  its ``handoff_id`` set to the handoff's.

The handoff id travels in ``kv_transfer_params`` because vLLM rewrites the
request id per instance. ``X-Request-Id`` is the client's, else the handoff id;
the client's ``Authorization`` goes to both engines (vLLM's ``--api-key``).

How the proxy learns that the coordinator canceled a handoff (its deadline,
an engine lost): while a leg is open it polls GetHandoff every
``--poll-interval-s``. A stream of the handoff's changes would tell sooner,
but the coordinator has no such call for a frontend; a poll costs one cheap
unary call per request in flight per interval, and bounds the delay before
the open leg is closed by the interval. When the coordinator does not answer
the polls, the proxy still closes the legs at the handoff's deadline (plus a
grace), unless the decode was already activated.

Every leg runs in a task raced against the handoff's end: a leg canceled
closes its HTTP connection, which vLLM turns into an abort of the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp

from handoff_client import (
    Completion,
    EngineType,
    Failed,
    Handoff,
    HandoffClient,
    LifecycleEventKind,
    Phase,
    Role,
)
from handoff_client.errors import (
    DeadlineExceededError,
    HandoffRpcError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from handoff_proxy.config import ProxyConfig
from handoff_proxy.errors import ProxyError
from handoff_proxy.metrics import ProxyMetrics
from handoff_proxy.pairs import Engine, Lease, NoEngineError, Pool

log = logging.getLogger("handoff.proxy")

T = TypeVar("T")
EXCERPT = 300  # characters of an engine's error body quoted in ours


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def label(self) -> str:
        return "completions" if self is Endpoint.COMPLETIONS else "chat_completions"


class ClientGone(Exception):
    """The client's connection closed while its answer was being written."""


class Background:
    """Tasks that outlive their request (a cancel to report); drained at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


@dataclass(slots=True)
class Services:
    """What every request shares."""

    config: ProxyConfig
    pool: Pool
    metrics: ProxyMetrics
    session: aiohttp.ClientSession
    client: HandoffClient | None  # None: --no-coordinator
    background: Background
    stopping: bool = False


def prefill_body(
    endpoint: Endpoint, body: dict[str, Any], handoff_id: str | None
) -> dict[str, Any]:
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if endpoint is Endpoint.CHAT:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill.pop("stream_options", None)  # vLLM refuses it without stream
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    if handoff_id is not None:
        params["handoff_id"] = handoff_id
    prefill["kv_transfer_params"] = params
    return prefill


def decode_body(
    body: dict[str, Any], params: dict[str, Any], handoff_id: str | None
) -> dict[str, Any]:
    decode = dict(body)
    decode["kv_transfer_params"] = (
        params if handoff_id is None else {**params, "handoff_id": handoff_id}
    )
    return decode


def excerpt(text: str) -> str:
    """An engine's error body, shortened; vLLM's JSON error reduced to its message."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        document = json.loads(text)
        message = document.get("error", document)
        text = str(message.get("message", message) if isinstance(message, dict) else message)
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT else text[: EXCERPT - 3] + "..."


class Exchange:
    """One request: ``async with`` it, then :meth:`start`, :meth:`prefill`,
    :meth:`open_decode`, and :meth:`relay` or :meth:`read_decode`.

    Leaving the block ends it: a :class:`ProxyError` is reported to the
    coordinator as the handoff's ``Failed`` fact (unless the coordinator ended
    it), a client gone (the handler canceled, or :class:`ClientGone`) as its
    ``Canceled`` fact, from a background task that outlives the request.
    """

    def __init__(
        self,
        services: Services,
        endpoint: Endpoint,
        body: dict[str, Any],
        request_id: str | None,
        authorization: str | None = None,
    ) -> None:
        self.services = services
        self.authorization = authorization
        self.config = services.config
        self.endpoint = endpoint
        self.body = body
        self.handoff_id = str(uuid.uuid4())
        self.request_id = request_id or self.handoff_id
        self.leg = "start"
        self.stream = bool(body.get("stream"))
        self._leases: tuple[Lease, Lease] | None = None
        self._started: asyncio.Task[Handoff] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()
        self._error: ProxyError | None = None  # why the handoff ended under the request
        self._deadline: datetime | None = None
        self._activated = False
        self._leg_started = time.monotonic()
        self._decode: aiohttp.ClientResponse | None = None

    @property
    def prefill_engine(self) -> Engine:
        assert self._leases is not None
        return self._leases[0].engine

    @property
    def decode_engine(self) -> Engine:
        assert self._leases is not None
        return self._leases[1].engine

    def _context(self, engine: Engine | None = None) -> dict[str, str]:
        extra = {"handoff_id": self.handoff_id}
        if engine is not None:
            extra["engine_id"] = engine.engine_id
        return extra

    # --- the block ---------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            self._leases = self.services.pool.pick()
        except NoEngineError as error:
            self.services.metrics.failures.labels("start", "no_engine").inc()
            raise ProxyError(503, str(error), why="no_engine") from None
        self._gauge()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._decode is not None:
            self._decode.close()
        if self._leases is not None:
            self._end_leg(self._leases[0], "prefill")
            self._end_leg(self._leases[1], "decode")
        metrics = self.services.metrics
        if isinstance(exc, ProxyError):
            metrics.failures.labels(exc.leg or self.leg, exc.why).inc()
            if self._error is None:  # not the coordinator's own end: tell it
                self._report_failure(exc)
        elif isinstance(exc, asyncio.CancelledError | ClientGone):
            metrics.disconnects.labels(self.leg).inc()
            self._abandon()
        elif exc is not None:
            self._report_failure(
                ProxyError(500, f"proxy error during the {self.leg} leg: {exc!r}", leg=self.leg)
            )

    def _end_leg(self, lease: Lease, leg: str) -> None:
        if lease.ended:
            return
        lease.end()
        self._gauge()
        if self.leg == leg:
            self.services.metrics.leg_duration.labels(leg).observe(
                time.monotonic() - self._leg_started
            )

    def _gauge(self) -> None:
        assert self._leases is not None
        for lease in self._leases:
            engine = lease.engine
            self.services.metrics.engine_in_flight.labels(engine.role, engine.engine_id).set(
                engine.in_flight
            )

    def _begin(self, leg: str) -> None:
        now = time.monotonic()
        if self.leg == "start" and leg != "start":
            self.services.metrics.leg_duration.labels("start").observe(now - self._leg_started)
        self.leg = leg
        self._leg_started = now

    # --- the coordinator ----------------------------------------------------

    async def start(self) -> None:
        """StartHandoff (not with --no-coordinator); 503 while the coordinator is unreachable."""
        client = self.services.client
        if client is None:
            return
        self._started = asyncio.create_task(self._start(client))
        # Shielded: a client gone mid-call must not lose the answer, which says
        # whether there is a handoff to cancel.
        handoff = await asyncio.shield(self._started)
        self._deadline = handoff.deadline
        self._watcher = asyncio.create_task(self._watch(client))

    async def _start(self, client: HandoffClient) -> Handoff:
        try:
            update = await client.start_handoff(
                self.handoff_id,
                engine_type=EngineType.VLLM,
                source_engine_id=self.prefill_engine.engine_id,
                destination_engine_id=self.decode_engine.engine_id,
                transfer_executor=Role.DESTINATION,  # vLLM's decode pulls the KV
                handoff_timeout_s=self.config.deadline_s,
                timeout_s=self.config.coordinator_timeout_s,
            )
        except HandoffRpcError as error:
            self.services.metrics.coordinator_errors.labels("start").inc()
            raise self._start_error(error) from error
        return update.handoff

    def _start_error(self, error: HandoffRpcError) -> ProxyError:
        where = f"the coordinator at {self.config.coordinator}"
        if isinstance(error, UnavailableError | DeadlineExceededError):
            status, why = 503, "no_coordinator"
            text = (
                f"{where} is unreachable ({error}); requests fail until it answers "
                "(is `handoff serve` running there? --coordinator)"
            )
        elif isinstance(error, UnauthenticatedError | PermissionDeniedError):
            status, why = 503, "coordinator_refused"
            text = (
                f"{where} refused the proxy's token ({error}); --token-file needs a token "
                "with the start, report and read scopes"
            )
        elif isinstance(error, ResourceExhaustedError):
            status, why = 503, "coordinator_busy"
            text = f"{where} is at an admission limit ({error}); retry later"
        else:
            status, why = 502, "coordinator_refused"
            text = f"{where} refused StartHandoff ({error})"
        return ProxyError(
            status,
            f"handoff {self.handoff_id} not started: {text}",
            leg="start",
            handoff_id=self.handoff_id,
            why=why,
        )

    async def _watch(self, client: HandoffClient) -> None:
        """Until the handoff is canceled on the coordinator (or its deadline passes unseen)."""
        interval = self.config.poll_interval_s
        grace_s = max(1.0, 2 * interval)
        while True:
            await asyncio.sleep(interval)
            self.services.metrics.polls.inc()
            try:
                handoff = await client.get_handoff(
                    self.handoff_id, timeout_s=self.config.coordinator_timeout_s
                )
            except HandoffRpcError as error:
                self.services.metrics.coordinator_errors.labels("get").inc()
                log.debug("GetHandoff failed: %s", error, extra=self._context())
            else:
                self._deadline = handoff.deadline or self._deadline
                self._activated = self._activated or any(
                    event.kind is LifecycleEventKind.DESTINATION_ACTIVATED
                    for event in handoff.lifecycle
                )
                if handoff.phase is Phase.CLEANING_UP or handoff.completion is Completion.CANCELED:
                    self._end(self._canceled(handoff))
                    return
            if (
                not self._activated
                and self._deadline is not None
                and datetime.now(UTC).timestamp() > self._deadline.timestamp() + grace_s
            ):
                self._end(self._deadline_error("and the coordinator did not answer to cancel it"))
                return

    def _canceled(self, handoff: Handoff) -> ProxyError:
        kinds = {event.kind for event in handoff.lifecycle}
        for kind, engine in (
            (LifecycleEventKind.SOURCE_LOST, self.prefill_engine),
            (LifecycleEventKind.DESTINATION_LOST, self.decode_engine),
        ):
            if kind in kinds:
                return self._error_on(
                    engine,
                    502,
                    f"handoff {self.handoff_id} canceled by the coordinator during the "
                    f"{self.leg} leg: it lost {engine.role} engine {engine.engine_id} "
                    f"({engine.url})",
                    "engine_lost",
                )
        ended = handoff.completed_at or datetime.now(UTC)
        if handoff.deadline is not None and ended >= handoff.deadline:
            return self._deadline_error("and the coordinator canceled it")
        engine = self._leg_engine()
        return self._error_on(
            engine,
            502,
            f"handoff {self.handoff_id} canceled on the coordinator during the {self.leg} "
            f"leg (engine {engine.engine_id}); `handoff inspect {self.handoff_id}` shows why",
            "canceled",
        )

    def _deadline_error(self, then: str) -> ProxyError:
        engine = self._leg_engine()
        return self._error_on(
            engine,
            504,
            f"handoff {self.handoff_id} passed its deadline ({self.config.deadline_s:g} s, "
            f"--deadline-s) during the {self.leg} leg on engine {engine.engine_id} "
            f"({engine.url}), {then}",
            "deadline",
        )

    def _error_on(self, engine: Engine, status: int, message: str, why: str) -> ProxyError:
        """An error of the open leg on ``engine``, naming the leg, the engine and the handoff."""
        return ProxyError(
            status,
            message,
            leg=self.leg,
            engine_id=engine.engine_id,
            handoff_id=self.handoff_id,
            why=why,
        )

    def _leg_engine(self) -> Engine:
        return self.prefill_engine if self.leg in ("start", "prefill") else self.decode_engine

    def _end(self, error: ProxyError) -> None:
        if self._error is None:
            self._error = error
            log.warning("%s", error.message, extra=self._context(self._leg_engine()))
            self._ended.set()

    def _report_failure(self, error: ProxyError) -> None:
        """The Failed fact for a handoff that a leg's failure ends; in the background."""
        client = self.services.client
        started = self._started
        if client is None or started is None or error.leg == "start":
            return
        reason = f"handoff proxy: {error.message}"
        log.warning("%s", error.message, extra=self._context(self._leg_engine()))
        self.services.background.spawn(
            self._tell(client, "fail", lambda: client.report_fact(self.handoff_id, Failed(reason)))
        )

    def _abandon(self) -> None:
        """The client is gone: cancel the handoff, with the leg it was in as the reason."""
        gone = "the proxy is shutting down" if self.services.stopping else "client disconnected"
        reason = f"handoff proxy: {gone} during the {self.leg} leg"
        log.info("%s", reason, extra=self._context(self._leg_engine()))
        client = self.services.client
        if client is None or self._started is None or self._error is not None:
            return
        self.services.background.spawn(
            self._tell(client, "cancel", lambda: client.cancel(self.handoff_id, reason))
        )

    async def _tell(
        self, client: HandoffClient, call: str, report: Callable[[], Awaitable[object]]
    ) -> None:
        started = self._started
        assert started is not None
        try:
            await started  # the start may still be on its way: the handoff exists after it
        except (ProxyError, asyncio.CancelledError):
            return  # never started: nothing to end
        try:
            await report()
        except NotFoundError:
            pass  # already ended and forgotten
        except HandoffRpcError as error:
            self.services.metrics.coordinator_errors.labels(call).inc()
            log.warning(
                "could not report the handoff's end (%s); its deadline ends it",
                error,
                extra=self._context(),
            )

    # --- the legs ----------------------------------------------------------

    async def guarded(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` in a task, canceled (closing its connection) if the handoff ends first."""
        task = asyncio.ensure_future(work)
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        if task.cancelled():
            assert self._error is not None
            raise self._error
        return task.result()

    def _headers(self) -> dict[str, str]:
        headers = {"X-Request-Id": self.request_id}
        if self.authorization is not None:  # vLLM's --api-key: the client's key goes on
            headers["Authorization"] = self.authorization
        return headers

    def _engine_error(self, engine: Engine, what: str) -> ProxyError:
        return self._error_on(
            engine,
            502,
            f"{self.leg} leg failed: {engine.role} engine {engine.engine_id} ({engine.url}) "
            f"{what} (handoff {self.handoff_id})",
            "engine_error",
        )

    async def prefill(self) -> dict[str, Any]:
        """The prefill leg; its answer's ``kv_transfer_params``."""
        self._begin("prefill")
        engine = self.prefill_engine
        handoff_id = self.handoff_id if self.services.client is not None else None
        body = prefill_body(self.endpoint, self.body, handoff_id)
        try:
            if self.services.client is None:  # no coordinator: the deadline is ours alone
                try:
                    async with asyncio.timeout(self.config.deadline_s):
                        return await self._post_prefill(engine, body)
                except TimeoutError:
                    raise self._deadline_error("so the proxy closed it") from None
            return await self.guarded(self._post_prefill(engine, body))
        finally:
            assert self._leases is not None
            self._end_leg(self._leases[0], "prefill")

    async def _post_prefill(self, engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
        url = engine.url + self.endpoint.value
        session = self.services.session
        try:
            async with session.post(url, json=body, headers=self._headers()) as response:
                text = await response.text()
                status = response.status
        except aiohttp.ClientError as error:
            raise self._engine_error(engine, f"could not be reached: {error!r}") from error
        if status != 200:
            raise self._engine_error(engine, f"answered HTTP {status}: {excerpt(text)}")
        try:
            answer = json.loads(text)
        except ValueError:
            raise self._engine_error(engine, f"answered no JSON: {excerpt(text)}") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise self._engine_error(
                engine,
                "answered without kv_transfer_params: is it started with a kv_producer "
                "connector (--kv-transfer-config)?",
            )
        return params

    async def open_decode(self, params: dict[str, Any]) -> aiohttp.ClientResponse:
        """The decode leg, up to its answer's headers (HTTP 200, or a ProxyError)."""
        self._begin("decode")
        handoff_id = self.handoff_id if self.services.client is not None else None
        body = decode_body(self.body, params, handoff_id)
        response = await self.guarded(self._post_decode(self.decode_engine, body))
        self._decode = response
        return response

    async def _post_decode(self, engine: Engine, body: dict[str, Any]) -> aiohttp.ClientResponse:
        url = engine.url + self.endpoint.value
        try:
            response = await self.services.session.post(url, json=body, headers=self._headers())
        except aiohttp.ClientError as error:
            raise self._engine_error(engine, f"could not be reached: {error!r}") from error
        if response.status == 200:
            return response
        try:
            text = await response.text()
        except aiohttp.ClientError:
            text = ""
        finally:
            response.release()
        raise self._engine_error(engine, f"answered HTTP {response.status}: {excerpt(text)}")

    async def read_decode(self) -> bytes:
        """The decode's whole answer (not streaming)."""
        assert self._decode is not None
        return await self.guarded(self._read(self._decode))

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        try:
            return await response.read()
        except aiohttp.ClientError as error:
            raise self._engine_error(
                self.decode_engine, f"broke off its answer: {error!r}"
            ) from error

    async def relay(
        self, write: Callable[[bytes], Awaitable[None]], first: Callable[[], None]
    ) -> None:
        """The decode's stream to ``write`` as it comes; ``first`` at its first bytes."""
        assert self._decode is not None
        await self.guarded(self._relay(self._decode, write, first))

    async def _relay(
        self,
        response: aiohttp.ClientResponse,
        write: Callable[[bytes], Awaitable[None]],
        first: Callable[[], None],
    ) -> None:
        seen = False
        while True:
            try:
                chunk = await response.content.readany()
            except aiohttp.ClientError as error:
                raise self._engine_error(
                    self.decode_engine, f"broke off its stream: {error!r}"
                ) from error
            if not chunk:
                return
            if not seen:
                seen = True
                first()
            try:
                await write(chunk)
            except ConnectionError as error:
                raise ClientGone(str(error)) from error
