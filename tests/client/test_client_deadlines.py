"""Every HandoffClient call returns within its timeout_s, whatever the retry policy.

Against a coordinator that is down two ways: nothing listens on the port
(every attempt is refused at once, so the retry policy alone would go on for
``within_s``), and a real socket that accepts connections and never answers
(the HTTP/2 handshake never completes: a black-holed coordinator).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from handoff_client import (
    Backoff,
    EngineType,
    HandoffClient,
    HandoffRpcError,
    Outcome,
    OutcomeKind,
    RetryPolicy,
    Role,
    TransferCompleted,
)
from handoff_client.errors import DeadlineExceededError, UnavailableError
from tests.support.fakes import free_port

TIMEOUT_S = 1.0
# Scheduling slack on a loaded 2-core machine: the bound is the timeout, not
# the policy's 15 s (or the 120 s below).
SLACK_S = 0.75
# A policy that would retry for two minutes if the deadline did not stop it.
GREEDY = RetryPolicy(max_attempts=100_000, backoff=Backoff(0.01, 0.05), within_s=120.0)

Call = Callable[[HandoffClient, float | None], Awaitable[object]]

CALLS: dict[str, Call] = {
    "start_handoff": lambda c, t: c.start_handoff(
        "h-deadline",
        engine_type=EngineType.VLLM,
        source_engine_id="prefill-0",
        destination_engine_id="decode-0",
        transfer_executor=Role.DESTINATION,
        timeout_s=t,
    ),
    "report_fact": lambda c, t: c.report_fact("h-deadline", TransferCompleted(), timeout_s=t),
    "cancel": lambda c, t: c.cancel("h-deadline", "the frontend gave up", timeout_s=t),
    "report_outcome": lambda c, t: c.report_outcome(
        "h-deadline", 0, Outcome(OutcomeKind.SUBMITTED), timeout_s=t
    ),
    "get_handoff": lambda c, t: c.get_handoff("h-deadline", timeout_s=t),
    "reconcile": lambda c, t: c.reconcile(
        "prefill-0",
        incarnation="i",
        session_id="s",
        held=[("h-deadline", Role.SOURCE)],
        freed=[],
        timeout_s=t,
    ),
}


@contextlib.asynccontextmanager
async def black_hole() -> AsyncIterator[int]:
    """A loopback port that accepts TCP connections and never says a byte."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0, family=socket.AF_INET)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.close()
        await server.wait_closed()


async def timed(call: Awaitable[object]) -> tuple[float, BaseException]:
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(HandoffRpcError) as raised:
        await call
    return loop.time() - began, raised.value


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("policy", [None, GREEDY], ids=["default-policy", "greedy-policy"])
async def test_a_call_to_a_coordinator_that_is_down_ends_by_its_timeout(
    name: str, policy: RetryPolicy | None
) -> None:
    async with (
        HandoffClient(f"127.0.0.1:{free_port()}", retry=policy) as client,
        asyncio.timeout(TIMEOUT_S + 10),
    ):
        took, error = await timed(CALLS[name](client, TIMEOUT_S))
    assert took < TIMEOUT_S + SLACK_S, f"{name} took {took:.2f} s with timeout_s={TIMEOUT_S}"
    assert isinstance(error, UnavailableError | DeadlineExceededError), error


@pytest.mark.parametrize("name", CALLS)
async def test_a_call_to_a_black_holed_coordinator_ends_by_its_timeout(name: str) -> None:
    async with (
        black_hole() as port,
        HandoffClient(f"127.0.0.1:{port}", retry=GREEDY) as client,
        asyncio.timeout(TIMEOUT_S + 10),
    ):
        took, error = await timed(CALLS[name](client, TIMEOUT_S))
    assert took < TIMEOUT_S + SLACK_S, f"{name} took {took:.2f} s with timeout_s={TIMEOUT_S}"
    assert isinstance(error, UnavailableError | DeadlineExceededError), error


async def test_the_clients_own_timeout_bounds_a_call_given_none() -> None:
    async with (
        HandoffClient(f"127.0.0.1:{free_port()}", timeout_s=TIMEOUT_S) as client,
        asyncio.timeout(TIMEOUT_S + 10),
    ):
        took, _ = await timed(CALLS["start_handoff"](client, None))
    assert took < TIMEOUT_S + SLACK_S
