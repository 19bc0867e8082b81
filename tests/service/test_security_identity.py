"""Engine identity over mutual TLS: certificate SANs bound to engine ids.

An engine may subscribe, report facts and report outcomes only as itself,
only for its own handoffs, and only the facts its role proves; a certificate
bound to no engine (a frontend) may start, read, cancel, fail, time out and
report a lost engine. Everything else is PERMISSION_DENIED and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.ops.config import Settings
from handoff_server.service.app import Server
from handoff_server.service.security import EngineIdentities, SecurityConfigError
from tests.support.rpc import (
    ACCEPTED,
    APPLIED,
    CANCELED,
    HELD,
    RESERVED,
    SCHEDULED,
    SUBMITTED,
    TRANSFERRED,
    ConnectEngine,
    StreamRecorder,
)
from tests.support.security import (
    DECODE_SAN,
    PREFILL_SAN,
    Pki,
    Stub,
    docs_block,
    make_pki,
    secure_channel,
)
from tests.support.servers import StartServer

TIMEOUT_S = 10.0
PREFILL = "prefill-0"
DECODE = "decode-0"
DENIED = grpc.StatusCode.PERMISSION_DENIED
FAILED = pb.Fact(failed=pb.Failed(reason="kv transfer broke"))
TIMED_OUT = pb.Fact(timed_out=pb.TimedOut())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def identity_file(folder: Path) -> str:
    path = folder / "engines.json"
    # One SAN given as a list, one as a bare string; prefill-1 has no live
    # certificate in these tests, it only takes part in someone else's handoff.
    path.write_text(
        json.dumps({PREFILL: [PREFILL_SAN], DECODE: DECODE_SAN, "prefill-1": ["p1.engines"]})
    )
    return str(path)


@dataclass
class Callers:
    server: Server
    frontend: Stub
    prefill: Stub
    decode: Stub


@pytest.fixture
async def callers(start_server: StartServer, pki: Pki, tmp_path: Path) -> AsyncIterator[Callers]:
    server = await start_server(
        **pki.tls_settings(mutual=True),
        engine_identity_file=identity_file(tmp_path),
        delivery_timeout_s=60.0,
    )
    async with (
        secure_channel(server.port, pki.ca.cert, pki.client) as frontend,
        secure_channel(server.port, pki.ca.cert, pki.prefill) as prefill,
        secure_channel(server.port, pki.ca.cert, pki.decode) as decode,
    ):
        yield Callers(
            server,
            pb_grpc.HandoffCoordinatorStub(frontend),
            pb_grpc.HandoffCoordinatorStub(prefill),
            pb_grpc.HandoffCoordinatorStub(decode),
        )


def start_request(source: str = PREFILL, destination: str = DECODE) -> pb.StartHandoffRequest:
    return pb.StartHandoffRequest(
        handoff_id=str(uuid.uuid4()),
        engine_type=pb.ENGINE_TYPE_VLLM,
        source_engine_id=source,
        destination_engine_id=destination,
        fallback_transfer_delay_ms=1.0,
    )


async def fact(stub: Stub, handoff_id: str, message: pb.Fact) -> pb.ReportFactResponse:
    return await stub.ReportFact(pb.ReportFactRequest(handoff_id=handoff_id, fact=message))


async def outcome(
    stub: Stub, handoff_id: str, action_id: int, message: pb.Outcome
) -> pb.ReportOutcomeResponse:
    return await stub.ReportOutcome(
        pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=action_id, outcome=message)
    )


async def snapshot(stub: Stub, handoff_id: str) -> bytes:
    response = await stub.GetHandoff(pb.GetHandoffRequest(handoff_id=handoff_id))
    return response.handoff.SerializeToString(deterministic=True)


async def denied(call: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code() is DENIED, caught.value
    return caught.value.details() or ""


async def stream_denied(call: grpc.aio.Call) -> str:
    assert await call.code() is DENIED
    return await call.details()


async def test_engines_complete_a_handoff_acting_as_themselves(callers: Callers) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        prefill = StreamRecorder(callers.prefill, PREFILL)
        decode = ConnectEngine(callers.decode, DECODE)
        await prefill.subscribed()
        await decode.subscribed()
        started = await callers.frontend.StartHandoff(start_request())
        handoff_id = started.handoff.handoff_id
        assert (await prefill.wait_for(handoff_id, 0)).kind == pb.ACTION_KIND_SUBMIT_PREFILL
        await outcome(callers.prefill, handoff_id, 0, SUBMITTED)
        await fact(callers.prefill, handoff_id, HELD)
        reserve = await decode.wait_for(handoff_id, 1)
        assert reserve.kind == pb.ACTION_KIND_RESERVE_DESTINATION
        report = pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=1, outcome=ACCEPTED)
        assert (await decode.report(report)).code == 0
        reserved = pb.ReportFactRequest(handoff_id=handoff_id, fact=RESERVED)
        assert (await decode.report(reserved)).code == 0
        await outcome(callers.prefill, handoff_id, 2, SCHEDULED)  # the source transfers
        await fact(callers.prefill, handoff_id, TRANSFERRED)
        activate = pb.ReportOutcomeRequest(handoff_id=handoff_id, action_id=3, outcome=APPLIED)
        assert (await decode.report(activate)).code == 0
        done = await outcome(callers.prefill, handoff_id, 4, APPLIED)
        assert done.handoff.completion == pb.COMPLETION_SUCCESS
        await prefill.close()
        await decode.close()


async def test_a_frontend_starts_reads_and_cancels_but_acts_for_no_engine(
    callers: Callers,
) -> None:
    frontend = callers.frontend
    async with asyncio.timeout(TIMEOUT_S):
        handoff_id = (await frontend.StartHandoff(start_request())).handoff.handoff_id
        before = await snapshot(frontend, handoff_id)
        message = await denied(outcome(frontend, handoff_id, 0, SUBMITTED))
        assert "router.frontend" in message  # names the certificate that was refused
        await denied(fact(frontend, handoff_id, HELD))
        await stream_denied(frontend.StreamActions(pb.StreamActionsRequest(engine_id=PREFILL)))
        hello = pb.ConnectRequest(hello=pb.ConnectHello(engine_id=DECODE))
        await stream_denied(frontend.Connect(iter([hello])))
        assert await snapshot(frontend, handoff_id) == before
        canceled = await fact(frontend, handoff_id, CANCELED)
        # No engine ever received anything: the server settles the cleanup itself.
        assert canceled.handoff.completion == pb.COMPLETION_CANCELED
    assert callers.server.engine_streams.live == {}


async def test_a_frontend_reports_a_lost_engine(callers: Callers) -> None:
    """A router that learns a pod died says so (docs/semantics.md, correction 7)."""
    frontend = callers.frontend
    async with asyncio.timeout(TIMEOUT_S):
        handoff_id = (await frontend.StartHandoff(start_request())).handoff.handoff_id
        lost = pb.Fact(engine_lost=pb.EngineLost(role=pb.ROLE_SOURCE))
        answer = await fact(frontend, handoff_id, lost)
        assert answer.handoff.completion == pb.COMPLETION_CANCELED
        kinds = [e.kind for e in answer.handoff.lifecycle]
        assert kinds == [pb.LIFECYCLE_EVENT_KIND_SOURCE_LOST, pb.LIFECYCLE_EVENT_KIND_COMPLETED]
        [complete] = answer.actions
        assert complete.completion == pb.COMPLETION_CANCELED


async def test_an_engine_acts_only_for_itself_and_its_own_handoffs(callers: Callers) -> None:
    prefill = callers.prefill
    async with asyncio.timeout(TIMEOUT_S):
        ours = (await callers.frontend.StartHandoff(start_request())).handoff.handoff_id
        theirs_request = start_request(source="prefill-1", destination=DECODE)
        theirs = (await callers.frontend.StartHandoff(theirs_request)).handoff.handoff_id
        await outcome(prefill, ours, 0, SUBMITTED)
        await fact(prefill, ours, HELD)  # issues ReserveDestination (1) to decode-0
        before = {h: await snapshot(prefill, h) for h in (ours, theirs)}

        # Not as another engine.
        details = await stream_denied(
            prefill.StreamActions(pb.StreamActionsRequest(engine_id=DECODE))
        )
        assert f"engine {DECODE}" in details
        # Not the outcome of an action addressed to the other side.
        details = await denied(outcome(prefill, ours, 1, ACCEPTED))
        assert f"addressed to {DECODE}" in details
        # Not for a handoff it takes no part in, whatever the report.
        await denied(outcome(prefill, theirs, 0, SUBMITTED))
        await denied(fact(prefill, theirs, CANCELED))
        # And the same through Connect, where a refusal is an ack and the
        # stream carries on.
        engine = ConnectEngine(prefill, PREFILL)
        await engine.subscribed()
        ack = await engine.report(pb.ReportFactRequest(handoff_id=theirs, fact=HELD))
        assert ack.code == DENIED.value[0]
        assert "no engine of this handoff" in ack.message
        ack = await engine.report(
            pb.ReportOutcomeRequest(handoff_id=ours, action_id=1, outcome=ACCEPTED)
        )
        assert ack.code == DENIED.value[0]
        assert {h: await snapshot(prefill, h) for h in (ours, theirs)} == before
        # What is its own still works on the same stream.
        ack = await engine.report(pb.ReportFactRequest(handoff_id=ours, fact=CANCELED))
        assert ack.code == 0
        await engine.close()
    metrics = callers.server.metrics.registry
    denials = {
        rpc: metrics.get_sample_value(
            "handoff_rejections_total", {"rpc": rpc, "code": "PERMISSION_DENIED"}
        )
        for rpc in ("StreamActions", "ReportOutcome", "ReportFact", "Connect")
    }
    assert denials == {"StreamActions": 1, "ReportOutcome": 2, "ReportFact": 1, "Connect": 2}


async def test_an_engine_reconciles_only_as_itself(callers: Callers) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        ours = (await callers.frontend.StartHandoff(start_request())).handoff.handoff_id
        await outcome(callers.prefill, ours, 0, SUBMITTED)
        before = await snapshot(callers.frontend, ours)
        # The prefill cannot free (nor report lost) the decode's side.
        as_decode = pb.ReconcileRequest(
            engine_id=DECODE, freed=[pb.HeldSide(handoff_id=ours, role=pb.ROLE_DESTINATION)]
        )
        details = await denied(callers.prefill.Reconcile(as_decode))
        assert f"engine {DECODE}" in details
        assert await snapshot(callers.frontend, ours) == before
        # As itself, from its live stream, it may: its held source goes on.
        stream = StreamRecorder(callers.prefill, PREFILL)
        await stream.subscribed()
        held = pb.ReconcileRequest(
            engine_id=PREFILL, held=[pb.HeldSide(handoff_id=ours, role=pb.ROLE_SOURCE)]
        )
        answer = await callers.prefill.Reconcile(held)
        assert list(answer.releases) == []
        assert answer.lost_applied == 0
        await stream.close()


async def test_a_certificate_from_another_ca_cannot_claim_an_engine(
    callers: Callers, pki: Pki
) -> None:
    # The rogue certificate carries prefill-0's SAN, but the TLS handshake
    # refuses it before any identity is looked at.
    async with (
        asyncio.timeout(TIMEOUT_S),
        secure_channel(callers.server.port, pki.ca.cert, pki.rogue_client) as rogue,
    ):
        stub: Stub = pb_grpc.HandoffCoordinatorStub(rogue)
        call = stub.StreamActions(pb.StreamActionsRequest(engine_id=PREFILL))
        assert await call.code() is grpc.StatusCode.UNAVAILABLE
    assert callers.server.engine_streams.live == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ("[]", "expected a non-empty object"),
        ('{"bad id!": ["x"]}', "is not an engine id"),
        ('{"prefill-0": []}', "needs a SAN"),
        ('{"prefill-0": [""]}', "needs a SAN"),
        ('{"prefill-0": ["email:p@engines"]}', "email SANs do not identify an engine"),
        ('{"prefill-0": ["DNS:"]}', "empty DNS SAN"),
    ],
)
async def test_unusable_identity_files_stop_the_start(
    pki: Pki, tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "engines.json"
    path.write_text(content)
    settings = dataclasses.replace(
        Settings(host="127.0.0.1", port=0, metrics_port=-1),
        engine_identity_file=str(path),
        **pki.tls_settings(mutual=True),
    )
    with pytest.raises(SecurityConfigError, match=message):
        await Server(settings).start()


async def test_each_fact_only_from_the_role_that_proves_it(callers: Callers) -> None:
    """Authorization by role and kind of fact, around the state machine: each
    refused report changes nothing, and the allowed one then goes through."""
    frontend, prefill, decode = callers.frontend, callers.prefill, callers.decode
    async with asyncio.timeout(TIMEOUT_S):
        handoff_id = (await frontend.StartHandoff(start_request())).handoff.handoff_id
        await outcome(prefill, handoff_id, 0, SUBMITTED)
        before = await snapshot(frontend, handoff_id)
        # SourceHeld: only the source.
        for stub in (decode, frontend):
            await denied(fact(stub, handoff_id, HELD))
        details = await denied(fact(decode, handoff_id, HELD))
        assert details.endswith(f"may not report SourceHeld: only {PREFILL} may"), details
        assert await snapshot(frontend, handoff_id) == before
        await fact(prefill, handoff_id, HELD)
        await outcome(decode, handoff_id, 1, ACCEPTED)
        # DestinationReserved: only the destination.
        for stub in (prefill, frontend):
            await denied(fact(stub, handoff_id, RESERVED))
        await fact(decode, handoff_id, RESERVED)
        await outcome(prefill, handoff_id, 2, SCHEDULED)
        # TransferCompleted: only the transfer's executor (here the source).
        for stub in (decode, frontend):
            await denied(fact(stub, handoff_id, TRANSFERRED))
        # TimedOut and EngineLost: only the frontend (the server reports its own).
        lost = pb.Fact(engine_lost=pb.EngineLost(role=pb.ROLE_DESTINATION))
        for stub in (prefill, decode):
            for message in (TIMED_OUT, lost):
                details = await denied(fact(stub, handoff_id, message))
                assert "only no engine (the frontend's or the server's to report) may" in details
        await fact(prefill, handoff_id, TRANSFERRED)
        timed_out = await fact(frontend, handoff_id, TIMED_OUT)
        assert timed_out.handoff.phase in (pb.PHASE_CLEANING_UP, pb.PHASE_COMPLETE)
        # Failed and Canceled: either engine or the frontend.
        for stub in (frontend, prefill, decode):
            for message in (FAILED, CANCELED):
                started = await frontend.StartHandoff(start_request())
                await fact(stub, started.handoff.handoff_id, message)


async def test_sans_are_matched_by_type(
    start_server: StartServer, pki: Pki, tmp_path: Path
) -> None:
    """A URI SAN spelled like the identity file's DNS name, or an email SAN,
    does not make its holder that engine."""
    path = tmp_path / "engines.json"
    path.write_text(json.dumps({PREFILL: ["DNS:prefill-0.typed"], DECODE: ["URI:decode-0.typed"]}))
    server = await start_server(**pki.tls_settings(mutual=True), engine_identity_file=str(path))
    impostors = {
        "uri-as-dns": pki.ca.issue("uri-as-dns", uris=("prefill-0.typed",)),
        "dns-as-uri": pki.ca.issue("dns-as-uri", dns=("decode-0.typed",)),
        "email": pki.ca.issue("email", emails=("prefill-0.typed@example.com",)),
    }
    genuine = pki.ca.issue("genuine", dns=("prefill-0.typed",))
    async with asyncio.timeout(TIMEOUT_S):
        for name, issued in impostors.items():
            async with secure_channel(server.port, pki.ca.cert, issued) as channel:
                stub: Stub = pb_grpc.HandoffCoordinatorStub(channel)
                for engine_id in (PREFILL, DECODE):
                    call = stub.StreamActions(pb.StreamActionsRequest(engine_id=engine_id))
                    assert await call.code() is DENIED, name
        async with secure_channel(server.port, pki.ca.cert, genuine) as channel:
            stub = pb_grpc.HandoffCoordinatorStub(channel)
            engine = StreamRecorder(stub, PREFILL)
            await engine.subscribed()
            await engine.close()


def test_the_identity_file_in_the_docs_binds_typed_sans() -> None:
    identities = EngineIdentities.parse(docs_block("json"), "docs/limits.md")
    assert identities.engines_for([("DNS", "prefill-0.engines.svc")]) == {"prefill-0"}
    assert identities.engines_for([("URI", "prefill-0.engines.svc")]) == frozenset()
    decode = ("URI", "spiffe://cluster.local/ns/serving/sa/decode-0")
    assert identities.engines_for([decode]) == {"decode-0"}


async def test_a_client_certificate_s_san_is_its_identity_for_the_limits(
    start_server: StartServer, pki: Pki
) -> None:
    server = await start_server(**pki.tls_settings(mutual=True), max_starts_per_s_per_identity=0.2)
    async with (
        asyncio.timeout(TIMEOUT_S),
        secure_channel(server.port, pki.ca.cert, pki.client) as frontend_channel,
        secure_channel(server.port, pki.ca.cert, pki.prefill) as other_channel,
    ):
        frontend: Stub = pb_grpc.HandoffCoordinatorStub(frontend_channel)
        other: Stub = pb_grpc.HandoffCoordinatorStub(other_channel)
        await frontend.StartHandoff(start_request())  # a burst of one; the next in 5 s
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await frontend.StartHandoff(start_request())
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            "certificate DNS:router.frontend starts more than 0.2 handoffs per second, "
            "the limit per identity (max_starts_per_s_per_identity)"
        )
        await other.StartHandoff(start_request())  # another certificate has its own
    assert len(server.registry.handoffs) == 2
