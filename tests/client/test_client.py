"""HandoffClient against a real server: typed answers, typed errors, retries, credentials."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from handoff_client import (
    ActionKind,
    Backoff,
    Canceled,
    ConnectTransport,
    EngineType,
    HandoffClient,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    RetryPolicy,
    Role,
    SourceHeld,
    TimingMode,
    TransferTiming,
)
from handoff_client.credentials import ChannelSecurity
from handoff_client.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    HandoffRpcError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    error_for,
)
from handoff_server.service.app import Server
from tests.support.fakes import free_port
from tests.support.security import Pki, make_pki
from tests.support.servers import FAST_RECONNECT, StartServer

TIMEOUT_S = 10.0
TOKEN = "s3cret-token-0123456789"


class CountingRandom(random.Random):
    """Counts backoff draws (one per retry) and wakes a waiter at each."""

    def __init__(self) -> None:
        super().__init__(0)
        self.draws = 0
        self.drawn = asyncio.Event()

    def uniform(self, a: float, b: float) -> float:
        self.draws += 1
        self.drawn.set()
        return super().uniform(a, b)


@pytest.fixture
async def client(lean_server: Server) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(f"127.0.0.1:{lean_server.port}", timeout_s=TIMEOUT_S) as client:
        yield client


async def start_vllm(client: HandoffClient, handoff_id: str | None = None) -> str:
    handoff_id = handoff_id or str(uuid.uuid4())
    await client.start_handoff(
        handoff_id,
        engine_type=EngineType.VLLM,
        source_engine_id="prefill-0",
        destination_engine_id="decode-0",
    )
    return handoff_id


async def test_calls_answer_with_typed_values(client: HandoffClient) -> None:
    handoff_id = str(uuid.uuid4())
    async with asyncio.timeout(TIMEOUT_S):
        started = await client.start_handoff(
            handoff_id,
            engine_type=EngineType.SGLANG,
            source_engine_id="prefill-0",
            destination_engine_id="decode-0",
            transfer_executor=Role.DESTINATION,
            handoff_timeout_s=30.0,
        )
        (reserve,) = started.actions
        accepted = await client.report_outcome(
            handoff_id, reserve.id, Outcome(OutcomeKind.ACCEPTED)
        )
        handoff = await client.get_handoff(handoff_id)
    assert started.handoff.order is Order.DESTINATION_FIRST  # implied by sglang
    assert (reserve.kind, reserve.target, reserve.engine_id) == (
        ActionKind.RESERVE_DESTINATION,
        Role.DESTINATION,
        "decode-0",
    )
    assert accepted.actions == ()  # DestinationReserved comes next, from the engine
    assert handoff.phase is Phase.ACTIVE
    assert handoff.completion is None
    assert handoff.transfer_executor is Role.DESTINATION
    assert handoff.outstanding_actions == ()
    assert handoff.started_at is not None
    assert handoff.deadline is not None
    assert 29 < (handoff.deadline - handoff.started_at).total_seconds() <= 30


async def test_each_refusal_raises_its_own_exception(client: HandoffClient) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        handoff_id = await start_vllm(client)
        with pytest.raises(AlreadyExistsError) as exists:  # a retry must repeat the request
            await client.start_handoff(
                handoff_id,
                engine_type=EngineType.VLLM,
                source_engine_id="prefill-0",
                destination_engine_id="decode-1",
            )
        with pytest.raises(NotFoundError):
            await client.get_handoff(str(uuid.uuid4()))
        with pytest.raises(NotFoundError):
            await client.report_outcome(handoff_id, 99, Outcome(OutcomeKind.SUBMITTED))
        with pytest.raises(InvalidArgumentError):  # SubmitPrefill is never APPLIED
            await client.report_outcome(handoff_id, 0, Outcome(OutcomeKind.APPLIED))
        with pytest.raises(FailedPreconditionError):  # held before the submission was acked
            await client.report_fact(
                handoff_id, SourceHeld(TransferTiming(TimingMode.FULL_PROMPT, 10))
            )
        with pytest.raises(InvalidArgumentError):
            await client.start_handoff(
                str(uuid.uuid4()),
                order=Order.SOURCE_FIRST,
                source_engine_id="not an engine id!",
                destination_engine_id="decode-0",
            )
    # Chained from the gRPC error, with the server's message (which names the handoff).
    assert isinstance(exists.value.__cause__, grpc.aio.AioRpcError)
    assert exists.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert handoff_id in exists.value.details
    # A refused call changed nothing: the right outcome is still accepted.
    async with asyncio.timeout(TIMEOUT_S):
        update = await client.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
    assert update.handoff.phase is Phase.ACTIVE


async def test_admission_limit_is_resource_exhausted(start_lean_server: StartServer) -> None:
    server = await start_lean_server(max_active_handoffs=1)
    async with HandoffClient(f"127.0.0.1:{server.port}") as client, asyncio.timeout(TIMEOUT_S):
        await start_vllm(client)
        with pytest.raises(ResourceExhaustedError):
            await start_vllm(client)


async def test_idempotent_calls_retry_until_the_server_is_up(
    start_lean_server: StartServer,
) -> None:
    port = free_port()
    rng = CountingRandom()
    retry = RetryPolicy(max_attempts=200, backoff=Backoff(initial_s=0.01, max_s=0.05))
    async with HandoffClient(
        f"127.0.0.1:{port}", retry=retry, rng=rng, channel_options=FAST_RECONNECT
    ) as client:
        lookup = asyncio.create_task(client.get_handoff(str(uuid.uuid4())))
        async with asyncio.timeout(TIMEOUT_S):
            await rng.drawn.wait()  # the first attempt failed and a retry is scheduled
            await start_lean_server(port=port)
            with pytest.raises(NotFoundError):  # it reached the server
                await lookup
    assert rng.draws >= 1


async def test_retries_stop_at_max_attempts() -> None:
    rng = CountingRandom()
    retry = RetryPolicy(max_attempts=3, backoff=Backoff(initial_s=0.01, max_s=0.02))
    async with HandoffClient(f"127.0.0.1:{free_port()}", retry=retry, rng=rng) as client:
        with pytest.raises(UnavailableError):
            async with asyncio.timeout(TIMEOUT_S):
                await client.report_outcome(str(uuid.uuid4()), 0, Outcome(OutcomeKind.NOOP))
    assert rng.draws == 3  # one backoff draw per failure; the third failure is final


async def test_start_handoff_retries_until_the_server_is_up(
    start_lean_server: StartServer,
) -> None:
    # Safe now: a retry of a start that did happen answers already_started.
    port = free_port()
    rng = CountingRandom()
    retry = RetryPolicy(max_attempts=200, backoff=Backoff(initial_s=0.01, max_s=0.05))
    async with HandoffClient(
        f"127.0.0.1:{port}", retry=retry, rng=rng, channel_options=FAST_RECONNECT
    ) as client:
        starting = asyncio.create_task(start_vllm(client))
        async with asyncio.timeout(TIMEOUT_S):
            await rng.drawn.wait()  # the first attempt failed and a retry is scheduled
            await start_lean_server(port=port)
            await starting
    assert rng.draws >= 1


async def test_start_handoff_gives_up_after_max_attempts() -> None:
    rng = CountingRandom()
    retry = RetryPolicy(max_attempts=3, backoff=Backoff(initial_s=0.01, max_s=0.02))
    async with HandoffClient(f"127.0.0.1:{free_port()}", retry=retry, rng=rng) as client:
        with pytest.raises(UnavailableError):
            async with asyncio.timeout(TIMEOUT_S):
                await start_vllm(client)
    assert rng.draws == 3


def test_a_status_lost_to_a_failed_write_is_unavailable_not_internal() -> None:
    # What gRPC's asyncio client raised in CI for a Connect refused while its
    # hello was being written (grpc/grpc issue 36066); any other INTERNAL stays.
    lost = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(),
        details="Internal error from Core",
        debug_error_string='Failed "execute_batch": '
        "(<grpc._cython.cygrpc.SendMessageOperation object at 0x7f9a3edb4a30>,)",
    )
    error = error_for(lost)
    assert isinstance(error, UnavailableError)
    assert "lost the server's reason" in error.details
    assert "36066" in error.details
    internal = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(),
        details="Internal error from Core",
        debug_error_string="",
    )
    assert type(error_for(internal)) is InternalError


async def test_the_token_goes_with_every_call(
    start_lean_server: StartServer, tmp_path: Path
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"sidecar {TOKEN} engines=prefill-0\n")  # it acts as prefill-0 too
    server = await start_lean_server(token_file=str(token_file))
    target = f"127.0.0.1:{server.port}"
    async with HandoffClient(target, token=TOKEN) as client, asyncio.timeout(TIMEOUT_S):
        handoff_id = await start_vllm(client)
        await client.report_outcome(handoff_id, 0, Outcome(OutcomeKind.SUBMITTED))
        await client.report_fact(handoff_id, Canceled("test"))
        assert (await client.get_handoff(handoff_id)).phase is Phase.CLEANING_UP
        async with contextlib.aclosing(client.stream_actions("prefill-0")) as actions:
            action = await anext(actions)
        assert action.kind is ActionKind.CANCEL_SOURCE
        connect = ConnectTransport(client)
        async with contextlib.aclosing(
            connect.subscribe("prefill-0", lambda: None, incarnation="", session_id="")
        ) as actions:
            action = await anext(actions)  # redelivered, on Connect this time
            await connect.report_outcome(handoff_id, action.id, Outcome(OutcomeKind.APPLIED))
        assert (await client.get_handoff(handoff_id)).phase is Phase.COMPLETE
    for token in (None, "not-the-token-" + TOKEN):
        async with HandoffClient(target, token=token) as client, asyncio.timeout(TIMEOUT_S):
            calls = [
                start_vllm(client),
                client.report_fact(handoff_id, Canceled("test")),
                client.report_outcome(handoff_id, 1, Outcome(OutcomeKind.APPLIED)),
                client.get_handoff(handoff_id),
                anext(client.stream_actions("prefill-0")),
                anext(
                    ConnectTransport(client).subscribe(
                        "prefill-0", lambda: None, incarnation="", session_id=""
                    )
                ),
            ]
            for call in calls:
                with pytest.raises(UnauthenticatedError):
                    await call


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def test_mutual_tls_with_certificates_as_paths_or_bytes(
    pki: Pki, start_lean_server: StartServer
) -> None:
    server = await start_lean_server(**pki.tls_settings(mutual=True))
    target = f"127.0.0.1:{server.port}"
    async with (
        HandoffClient(
            target,
            tls_root_cert=pki.ca.cert_path,  # a path
            tls_client_cert=pki.client.cert,  # PEM bytes
            tls_client_key=str(pki.client.key_path),  # a path as str
        ) as client,
        asyncio.timeout(TIMEOUT_S),
    ):
        handoff_id = await start_vllm(client)
        assert (await client.get_handoff(handoff_id)).phase is Phase.ACTIVE
    one_try = RetryPolicy(max_attempts=1)
    async with (
        HandoffClient(target, tls_root_cert=pki.ca.cert, retry=one_try) as no_client_cert,
        HandoffClient(target, retry=one_try) as plaintext,
    ):
        for refused in (no_client_cert, plaintext):
            with pytest.raises(UnavailableError):
                async with asyncio.timeout(TIMEOUT_S):
                    await refused.get_handoff(handoff_id)


def test_security_options() -> None:
    assert ChannelSecurity.from_options(
        tls=None, tls_root_cert=None, tls_client_cert=None, tls_client_key=None, token="s3cret"
    ).metadata() == (("authorization", "Bearer s3cret"),)
    implied = ChannelSecurity.from_options(
        tls=None, tls_root_cert=b"PEM", tls_client_cert=None, tls_client_key=None, token=None
    )
    assert implied.tls
    assert implied.root_cert == b"PEM"
    assert implied.metadata() == ()
    with pytest.raises(ValueError, match="go together"):
        ChannelSecurity.from_options(
            tls=True, tls_root_cert=None, tls_client_cert=b"c", tls_client_key=None, token=None
        )
    with pytest.raises(ValueError, match="tls=False"):
        ChannelSecurity.from_options(
            tls=False, tls_root_cert=b"r", tls_client_cert=None, tls_client_key=None, token=None
        )
    with pytest.raises(ValueError, match="single line"):
        ChannelSecurity.from_options(
            tls=None, tls_root_cert=None, tls_client_cert=None, tls_client_key=None, token="a\nb"
        )


def test_every_status_has_its_exception() -> None:
    from handoff_client import errors

    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        classes = [
            cls
            for cls in vars(errors).values()
            if isinstance(cls, type) and issubclass(cls, HandoffRpcError) and cls.code is code
        ]
        # UNKNOWN: the base class too; FAILED_PRECONDITION: the two fencing
        # refusals and the misrouted start too.
        expected = {grpc.StatusCode.UNKNOWN: 2, grpc.StatusCode.FAILED_PRECONDITION: 4}
        assert len(classes) == expected.get(code, 1), code
