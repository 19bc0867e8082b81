"""The running service: gRPC server, health, reflection, metrics endpoint, timers, drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from handoff_server.domain.registry import Clock, Registry
from handoff_server.durability.journal import Journal, fresh_incarnation
from handoff_server.durability.records import JournalRecorder
from handoff_server.durability.recovery import Recovery, ReplayClock, recover
from handoff_server.durability.space import Headroom
from handoff_server.ops import tracing
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from handoff_server.service import bindings, exposure, methods, probes, security
from handoff_server.service.exposition import MetricsEndpoint
from handoff_server.service.guard import EXCLUSIVE_PORT, EngineStreams, Guard, grpc_options
from handoff_server.service.quotas import Budget, Quotas
from handoff_server.service.servicer import Servicer
from handoff_server.service.shards import ShardIdentity, Shards, hostname

log = logging.getLogger("handoff.server")

SERVICE_NAME = methods.COORDINATOR.full_name


class WallClock:
    """Unix time that never jumps: anchored once, then advanced by the monotonic clock."""

    def __init__(self) -> None:
        self._offset = time.time() - time.monotonic()

    def __call__(self) -> float:
        return self._offset + time.monotonic()


class Server:
    def __init__(
        self,
        settings: Settings,
        clock: Clock | None = None,
        tracer: tracing.Tracer | None = None,
        shard: ShardIdentity | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock if clock is not None else WallClock()
        # With a journal, the registry's clock reads each record's time while
        # the journal replays (recovery.py).
        self._replay_clock = ReplayClock(self.clock) if settings.state_dir else None
        self.metrics = Metrics()
        # Resolved before anything starts: a shard that cannot say who it is must not serve.
        self.shards = Shards(
            settings,
            shard if shard is not None else ShardIdentity.resolve(settings, hostname()),
            self.metrics,
        )
        self._timer_wakeup = asyncio.Event()
        self._fired_for_s = 0.0  # how long the last fire_due ran
        # A tracer given (a test's) is its giver's to shut down; one made here is ours.
        self._own_tracer = tracer is None
        self.tracer = (
            tracer if tracer is not None else tracing.from_settings(settings.otlp_endpoint)
        )
        self.registry = Registry(
            settings,
            self.metrics,
            self._replay_clock or self.clock,
            self._timer_wakeup.set,
            self.tracer,
        )
        self.journal: Journal | None = None
        self.recovery: Recovery | None = None
        self.incarnation = 0  # the coordinator's, new at each start (see _open_journal)
        # Set when the journal cannot be written: the process must stop (serve.py).
        self.failed = asyncio.Event()
        # Set when another process holds the journal: the process must drain (serve.py).
        self.held = asyncio.Event()
        self.headroom: Headroom | None = None
        self.health = HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self.health_port = 0
        self.engine_streams = EngineStreams(settings.max_engines)
        self.service_calls = Budget("calls", settings.max_concurrent_rpcs, "max_concurrent_rpcs")
        self.quotas = Quotas(
            calls=settings.max_calls_per_identity,
            engines=settings.max_engines_per_identity,
            active=settings.max_active_handoffs_per_identity,
            starts_per_s=settings.max_starts_per_s_per_identity,
            calls_per_s=settings.max_calls_per_s_per_identity,
            reports_per_s=settings.max_reports_per_s_per_identity,
            rate_wait_s=settings.rate_wait_s,
            clock=self.clock,
        )
        self.registry.on_finished(self.quotas.finished)
        self._grpc: grpc.aio.Server | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._timers: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self.registry.on_idle(self._idle.set)

    async def start(self) -> None:
        settings = self.settings
        # Every file is read before anything binds: a bad one stops the start.
        credentials = security.server_credentials(settings)
        tokens = security.load_tokens(settings)
        identities = security.load_identities(settings)
        self._open_journal()
        try:
            await self._serve(credentials, tokens, identities)
        except BaseException:
            if self.journal is not None:
                self.journal.close_now()
            raise

    def _open_journal(self) -> None:
        """Recover from the state dir, if there is one; journal from now on."""
        settings = self.settings
        if self._replay_clock is None:
            self.incarnation = fresh_incarnation()
            log.info(
                "no state dir: handoffs are kept in memory only and lost if this process dies "
                "(--state-dir keeps them)"
            )
            return
        journal = Journal.open(
            Path(settings.state_dir), settings.durability, settings.journal_busy_timeout_s
        )
        try:
            self.recovery = recover(journal, self.registry, self._replay_clock)
        except BaseException:
            journal.close_now()
            raise
        self.journal = journal
        self.incarnation = journal.incarnation
        self.registry.recorder = JournalRecorder(journal)
        journal.on_failure = lambda error: self.failed.set()
        journal.on_held = lambda reason: self.held.set()
        journal.start_writer(settings.journal_commit_delay_ms / 1000)
        self.headroom = Headroom(
            journal.state_dir,
            settings.journal_reserve_mib,
            journal.reusable_bytes,
            journal.measure_reusable,
        )
        self.headroom.report_at_start()
        log.info(
            "journal at %s (durability %s), coordinator incarnation %d",
            settings.state_dir,
            settings.durability,
            self.incarnation,
        )

    def _servicer(self) -> Servicer:
        recovered = self.recovery is not None and self.recovery.total > 0
        headers = (
            ("handoff-coordinator-incarnation", str(self.incarnation)),
            ("handoff-recovered", "true" if recovered else "false"),
            ("handoff-delivery-timeout-ms", str(round(self.settings.delivery_timeout_s * 1000))),
            ("handoff-heartbeat-ms", str(round(self.settings.heartbeat_interval_s * 1000))),
        )
        journal, headroom = self.journal, self.headroom
        if journal is None or headroom is None:
            return Servicer(
                self.registry, self.metrics, subscription_headers=headers, shards=self.shards
            )
        return Servicer(
            self.registry,
            self.metrics,
            shards=self.shards,
            journal=journal,
            subscription_headers=headers,
            engine_incarnation=journal.engine,
            admit_start=headroom.check_start,
        )

    async def _serve(
        self,
        credentials: grpc.ServerCredentials | None,
        tokens: security.TokenSet | None,
        identities: security.EngineIdentities | None,
    ) -> None:
        settings = self.settings
        guard = Guard(
            metrics=self.metrics,
            streams=self.engine_streams,
            calls=self.service_calls,
            quotas=self.quotas,
            tokens=tokens,
            exempt=tuple(p.strip() for p in settings.auth_exempt_methods.split(",") if p.strip()),
            identities=identities,
            client_certificates=bool(settings.tls_client_ca),
            request_within_s=settings.request_within_s,
        )
        server = grpc.aio.server(
            interceptors=(guard,),
            options=grpc_options(settings),
            # Every call is counted as it arrives, by the guard or the health
            # gate: gRPC's own limit is theirs together, the backstop for
            # calls refused before either counts them (a missing token).
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs + self._health_calls(),
        )
        methods.register(server, SERVICE_NAME, methods.coordinator_handlers(self._servicer()))
        methods.register(server, probes.SERVICE, self._health_gate().handlers())
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"{settings.host}:{settings.port}"
        with _bind_errors("gRPC", address):
            if credentials is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, credentials)
        self.shards.port = self.port
        health_server = self._health_only_server() if settings.health_port >= 0 else None
        await server.start()
        self._grpc = server
        if health_server is not None:
            await health_server.start()
            self._health_grpc = health_server
        if settings.metrics_port >= 0:
            endpoint = MetricsEndpoint(self.metrics.registry)
            try:
                with _bind_errors("metrics", f"{settings.metrics_host}:{settings.metrics_port}"):
                    port = await endpoint.start(settings.metrics_host, settings.metrics_port)
            except OSError:
                # What started must stop on this loop, or gRPC's shutdown runs
                # when the loop is gone ("Event loop is closed").
                await self._shut_down()
                raise
            self.metrics_port = port
            self._metrics_endpoint = endpoint
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._timers = asyncio.create_task(self._run_timers(), name="handoff-timers")
        transport = (
            "plaintext"
            if credentials is None
            else "mutual TLS"
            if settings.tls_client_ca
            else "TLS"
        )
        log.info(
            "serving gRPC (%s; %s; %s) on %s:%d, %s",
            transport,
            f"{len(tokens)} bearer tokens" if tokens else "no token required",
            f"{len(identities)} engine identities" if identities else "engine ids not bound",
            settings.host,
            self.port,
            f"metrics on {settings.metrics_host}:{self.metrics_port}"
            if self._metrics_endpoint is not None
            else "metrics off",
        )
        if self._health_grpc is not None:
            log.info("health only, plaintext, on %s:%d", settings.health_host, self.health_port)
        if tokens is not None and credentials is None:
            log.warning("bearer tokens over plaintext can be read by anyone on the network path")
        exposure.warn_if_open(settings.host, tls=credentials is not None, tokens=bool(tokens))
        mutual = bool(settings.tls_client_ca)
        for warning in bindings.binding_warnings(tokens, identities, mutual=mutual):
            log.warning("%s", warning)

    def _health_only_server(self) -> grpc.aio.Server:
        """The same health service on a plaintext port of its own, and nothing
        else: the kubelet's gRPC probes speak neither TLS nor tokens, and a
        serving status is no secret. Bound here, started with the main port."""
        settings = self.settings
        server = grpc.aio.server(
            options=[
                EXCLUSIVE_PORT,
                ("grpc.max_receive_message_length", 1024),
                # A probe opens a connection per check: few calls per connection
                # make a crowd of calls cost a crowd of connections.
                ("grpc.max_concurrent_streams", 8),
            ],
            maximum_concurrent_rpcs=self._health_calls(),
        )
        methods.register(server, probes.SERVICE, self._health_gate().handlers())
        address = f"{settings.health_host}:{settings.health_port}"
        with _bind_errors("health", address):
            self.health_port = server.add_insecure_port(address)
        return server

    def _health_gate(self) -> probes.HealthGate:
        """Health for one port, on budgets of that port's own."""
        settings = self.settings
        return probes.HealthGate(
            self.health,
            checks=settings.max_health_checks,
            watches=settings.max_health_watches,
            request_within_s=settings.health_request_within_s,
        )

    def _health_calls(self) -> int:
        return self.settings.max_health_checks + self.settings.max_health_watches

    async def _run_timers(self) -> None:
        """Sleep until the registry's next timer (or an earlier one appears), then fire.

        Supervised: fire_due already survives a failing timer; anything else
        that raises here is logged and counted, and the loop goes on, since
        deadlines, redelivery and retention all hang on it."""
        while True:
            try:
                await self._next_timers()
            except Exception:
                self.metrics.timer_errors.inc()
                log.exception("timer loop failed; going on")
                await asyncio.sleep(0.1)  # a failure that repeats must not spin

    async def _next_timers(self) -> None:
        wakeup = self.registry.next_wakeup()
        self._timer_wakeup.clear()
        if wakeup is None:
            await self._timer_wakeup.wait()
        else:
            delay = wakeup - self.clock()
            if delay > 0:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a
                # cancellation that lands as the wake-up fires, and stop() then
                # waited for this task forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._timer_wakeup.wait()
            else:
                # Work due at once again (a lost engine's backlog, a chunk at
                # a time): it takes half the loop's time at most, so calls and
                # health probes keep being answered while it goes on.
                await asyncio.sleep(self._fired_for_s)
        began = time.perf_counter()
        self.registry.fire_due()
        self._fired_for_s = time.perf_counter() - began

    async def wait_idle(self, within_s: float) -> bool:
        """Until no handoff is active or cleaning up; False if ``within_s`` passed first."""
        try:
            async with asyncio.timeout(within_s):
                while self.registry.active_count > 0:
                    self._idle.clear()
                    await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Drain: refuse new handoffs, let active ones finish, cancel the rest, clean up."""
        grace = self.settings.drain_grace_s
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.registry.draining = True
        log.info("draining: %d handoffs unfinished", self.registry.active_count)
        try:
            await self._drain(grace)
        finally:
            await self._shut_down()

    async def _drain(self, grace: float) -> None:
        if not await self.wait_idle(grace):
            canceled = self.registry.cancel_active("server shutting down")
            log.warning("drain grace over; canceled %d handoffs", canceled)
            if not await self.wait_idle(grace):
                log.error("%d handoffs still cleaning up at exit", self.registry.active_count)

    async def _shut_down(self) -> None:
        """Everything after the drain; it runs whatever happened before."""
        if self._timers is not None:
            self._timers.cancel()
            try:
                await self._timers
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("the timer task had failed")
        self.registry.close_streams()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._health_grpc is not None:
            await self._health_grpc.stop(grace=None)
        if self._metrics_endpoint is not None:
            await self._metrics_endpoint.stop()
        if self.journal is not None:
            await self.journal.close()
        if self.tracer.on and self._own_tracer:
            # Exports the spans still buffered: blocking, so off the loop.
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.shutdown)
        log.info("stopped")


@contextlib.contextmanager
def _bind_errors(what: str, address: str) -> Iterator[None]:
    """gRPC's bind failure (a RuntimeError, or port 0) as the OSError `handoff serve` reports."""
    try:
        yield
    except (RuntimeError, OSError) as error:
        flags = BIND_FLAGS[what]
        raise OSError(
            f"cannot bind {what} on {address}: in use by another process (a second "
            f"coordinator?), or not an address of this host; change {flags}"
        ) from error


BIND_FLAGS = {
    "gRPC": "--host/--port",
    "health": "--health-host/--health-port (-1: off)",
    "metrics": "--metrics-host/--metrics-port (-1: off)",
}
