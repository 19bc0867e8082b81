"""Every conformance vector, driven through a running server over real gRPC."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.commands.conformance import Failure, StartStep, Vector, mismatch, step_op
from handoff_server.domain.model import Action, ActionKind
from handoff_server.service.app import Server
from tests.support.rpc import (
    DESTINATION,
    SOURCE,
    ActionLog,
    ConnectEngine,
    StreamRecorder,
    answer,
    call_connect,
    call_unary,
    core_action,
    observe_state,
    same_delay,
)
from tests.support.vectors import LOST_VECTORS, VECTORS, all_vectors

CONCURRENCY = 16
SOURCE_KINDS = {ActionKind.SUBMIT_PREFILL, ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE}
DESTINATION_KINDS = {
    ActionKind.RESERVE_DESTINATION,
    ActionKind.ACTIVATE_DESTINATION,
    ActionKind.CANCEL_DESTINATION,
}


async def run_vector(
    stub: pb_grpc.HandoffCoordinatorAsyncStub,
    vector: Vector,
    source: ActionLog,
    destination: ActionLog,
) -> Failure | None:
    handoff_id = vector.handoff_id
    for index, step in enumerate(vector.steps):
        if isinstance(source, ConnectEngine):
            # Reports travel on the source's Connect stream, whoever they are about.
            ok, code, message, actions = await call_connect(stub, source, handoff_id, step)
        else:
            ok, code, message, actions = await call_unary(stub, handoff_id, step)
        state = await observe_state(stub, handoff_id)
        reason = mismatch(step.expect, answer(ok, code, message, actions, state))
        if reason is None:
            reason = check_completions(step.expect.completion, actions)
        if reason is None:
            reason = await check_routing(handoff_id, actions, source, destination)
        if reason is not None:
            return Failure(vector.name, index, step_op(step), reason)
        if isinstance(step, StartStep) and not ok:
            return None
    return None


def check_completions(expected: str | None, actions: tuple[Action, ...]) -> str | None:
    """A Complete says how the handoff ended: the completion the call left it in."""
    for action in actions:
        if action.kind is ActionKind.COMPLETE:
            got = None if action.completion is None else action.completion.value
            if got != expected:
                return f"Complete {action.id} carries completion {got}, expected {expected}"
    return None


async def check_routing(
    handoff_id: str,
    actions: tuple[Action, ...],
    source: ActionLog,
    destination: ActionLog,
) -> str | None:
    """Each action must reach its engine's stream (Complete: both), intact."""
    for action in actions:
        targets: list[ActionLog] = []
        if action.kind in SOURCE_KINDS or action.kind is ActionKind.START_TRANSFER:
            targets = [source]  # the default transfer executor is the source
        elif action.kind in DESTINATION_KINDS:
            targets = [destination]
        else:
            targets = [source, destination]
        for stream in targets:
            # Awaited, not timed: a loaded machine delivers late, not never
            # (the test's own timeout bounds a delivery that never comes).
            delivered = await stream.wait_for(handoff_id, action.id)
            if delivered.engine_id != stream.engine_id:
                return f"action {action.id} delivered with engine_id {delivered.engine_id}"
            if action.kind is ActionKind.START_TRANSFER and not same_delay(
                delivered.delay_ms, action.delay_ms or 0.0
            ):
                return f"action {action.id} delivered with delay {delivered.delay_ms}"
            completion = core_action(delivered).completion
            if completion is not action.completion:
                return f"action {action.id} delivered with completion {completion}"
    return None


@pytest.mark.parametrize("vectors_file", [VECTORS, LOST_VECTORS], ids=["vectors", "lost"])
@pytest.mark.parametrize("transport", ["unary", "connect", "connect-batch"])
async def test_all_vectors_pass_through_a_running_server(
    server: Server, transport: str, vectors_file: Path
) -> None:
    """Facts and outcomes on the unary RPCs (actions on StreamActions), or all on
    Connect: one item per message, or packed (``ConnectHello.batch``, reports in
    ``ConnectRequest.reports``; the vectors run concurrently, so the server packs
    acks and actions of several at once)."""
    vectors = all_vectors(vectors_file)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        engines: list[StreamRecorder] | list[ConnectEngine]
        if transport == "unary":
            engines = [StreamRecorder(stub, SOURCE), StreamRecorder(stub, DESTINATION)]
        else:
            batch = transport == "connect-batch"
            engines = [ConnectEngine(stub, SOURCE, batch), ConnectEngine(stub, DESTINATION, batch)]
        for engine in engines:
            await engine.subscribed()
        source, destination = engines
        limit = asyncio.Semaphore(CONCURRENCY)

        async def one(vector: Vector) -> Failure | None:
            async with limit:
                return await run_vector(stub, vector, source, destination)

        try:
            async with asyncio.timeout(240):
                results = await asyncio.gather(*(one(v) for v in vectors))
        finally:
            for engine in engines:
                await engine.close()
    failures = [str(f) for f in results if f is not None]
    assert failures == []
    assert server.registry.handoffs, "the vectors left no retained handoffs behind"
