"""The floor: the coordinator's RPCs with empty handlers, to price gRPC itself.

Every unary handler returns an empty response; Connect echoes a bare ack per
report, packed with the actions into one message when the hello asks for
batching, as the service does. So that the bench's engines (bench/load.py) can run against it
unchanged, the floor also pushes the actions of a success path, from a fixed
script keyed by what was reported, instead of running a state machine: one
dict lookup per message. Its streams linger as the service's do (service/linger.py),
so both write alike. What the service costs beyond this is coordination.

Run: .venv/bin/python -m bench.floor --port 0   (prints the address it serves)
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator

import grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.commands.serve import loop_factory
from handoff_server.ops.config import Settings, env_name
from handoff_server.service import methods
from handoff_server.service.convert import reports_of
from handoff_server.service.linger import Linger, Wake

SOURCE_FIRST = pb.HANDOFF_ORDER_SOURCE_FIRST
LINGER_VARIABLE = env_name("stream_linger_ms")
Message = pb.Action | pb.ConnectResponse


class Outlet:
    """One engine's stream: what waits to be written, and a wake-up."""

    def __init__(self, wrap: bool, batch: bool = False) -> None:
        self.wrap = wrap  # Connect wraps actions in a ConnectResponse
        self.batch = batch  # Connect after ConnectHello.batch: everything ready in one message
        self.queue: deque[Message] = deque()
        self.acks: list[pb.ConnectAck] = []  # batched only
        self.actions: list[pb.Action] = []  # batched only
        self.ready = Wake()

    def push_action(self, action: pb.Action) -> None:
        if self.batch:
            self.actions.append(action)
        else:
            self.queue.append(pb.ConnectResponse(action=action) if self.wrap else action)
        self.ready.set()

    def push_ack(self, ack: pb.ConnectAck) -> None:
        if self.batch:
            self.acks.append(ack)
        else:
            self.queue.append(pb.ConnectResponse(ack=ack))
        self.ready.set()

    def end(self) -> None:
        self.queue.append(END)
        self.ready.set()

    async def drain(self, linger_s: float) -> AsyncIterator[Message]:
        linger = Linger(linger_s)
        while True:
            self.ready.clear()
            await linger.wait()
            if self.acks or self.actions:
                message = pb.ConnectResponse(acks=self.acks, actions=self.actions)
                self.acks, self.actions = [], []  # before the yield: more arrive meanwhile
                yield message
                linger.wrote()
            while self.queue:
                yield self.queue.popleft()
                linger.wrote()
            await self.ready.wait()
            linger.woke(self.ready)


class Floor(pb_grpc.HandoffCoordinatorServicer):
    def __init__(self, linger_s: float) -> None:
        self.linger_s = linger_s  # the service's stream linger, so both write alike
        self.outlets: dict[str, Outlet] = {}
        self.handoffs: dict[str, tuple[int, str, str]] = {}  # id -> order, source, destination

    def _send(
        self, handoff_id: str, action_id: int, kind: pb.ActionKind.ValueType, engine_id: str
    ) -> None:
        outlet = self.outlets.get(engine_id)
        if outlet is None:
            return
        outlet.push_action(
            pb.Action(
                handoff_id=handoff_id, id=action_id, kind=kind, attempt=1, engine_id=engine_id
            )
        )

    def _after_fact(self, request: pb.ReportFactRequest) -> None:
        known = self.handoffs.get(request.handoff_id)
        if known is None:
            return
        order, source, destination = known
        which = request.fact.WhichOneof("kind")
        if which == "source_held":
            if order == SOURCE_FIRST:
                self._send(request.handoff_id, 1, pb.ACTION_KIND_RESERVE_DESTINATION, destination)
            else:
                self._send(request.handoff_id, 2, pb.ACTION_KIND_START_TRANSFER, source)
        elif which == "destination_reserved":
            if order == SOURCE_FIRST:
                self._send(request.handoff_id, 2, pb.ACTION_KIND_START_TRANSFER, source)
            else:
                self._send(request.handoff_id, 1, pb.ACTION_KIND_SUBMIT_PREFILL, source)
        elif which == "transfer_completed":
            self._send(request.handoff_id, 3, pb.ACTION_KIND_ACTIVATE_DESTINATION, destination)

    def _after_outcome(self, request: pb.ReportOutcomeRequest) -> None:
        if request.action_id == 3:
            known = self.handoffs.get(request.handoff_id)
            if known is not None:
                self._send(request.handoff_id, 4, pb.ACTION_KIND_RELEASE_SOURCE, known[1])
        elif request.action_id == 4:
            known = self.handoffs.pop(request.handoff_id, None)
            if known is not None:
                for engine_id in known[1:]:
                    self._send(request.handoff_id, 5, pb.ACTION_KIND_COMPLETE, engine_id)

    async def StartHandoff(
        self,
        request: pb.StartHandoffRequest,
        context: grpc.aio.ServicerContext[pb.StartHandoffRequest, pb.StartHandoffResponse],
    ) -> pb.StartHandoffResponse:
        source, destination = request.source_engine_id, request.destination_engine_id
        self.handoffs[request.handoff_id] = (request.order, source, destination)
        if request.order == SOURCE_FIRST:
            self._send(request.handoff_id, 0, pb.ACTION_KIND_SUBMIT_PREFILL, source)
        else:
            self._send(request.handoff_id, 0, pb.ACTION_KIND_RESERVE_DESTINATION, destination)
        return pb.StartHandoffResponse()

    async def ReportFact(
        self,
        request: pb.ReportFactRequest,
        context: grpc.aio.ServicerContext[pb.ReportFactRequest, pb.ReportFactResponse],
    ) -> pb.ReportFactResponse:
        self._after_fact(request)
        return pb.ReportFactResponse()

    async def ReportOutcome(
        self,
        request: pb.ReportOutcomeRequest,
        context: grpc.aio.ServicerContext[pb.ReportOutcomeRequest, pb.ReportOutcomeResponse],
    ) -> pb.ReportOutcomeResponse:
        self._after_outcome(request)
        return pb.ReportOutcomeResponse()

    async def Reconcile(
        self,
        request: pb.ReconcileRequest,
        context: grpc.aio.ServicerContext[pb.ReconcileRequest, pb.ReconcileResponse],
    ) -> pb.ReconcileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not part of the floor")

    async def GetShardMap(
        self,
        request: pb.GetShardMapRequest,
        context: grpc.aio.ServicerContext[pb.GetShardMapRequest, pb.GetShardMapResponse],
    ) -> pb.GetShardMapResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not part of the floor")

    async def GetHandoff(
        self,
        request: pb.GetHandoffRequest,
        context: grpc.aio.ServicerContext[pb.GetHandoffRequest, pb.GetHandoffResponse],
    ) -> pb.GetHandoffResponse:
        return pb.GetHandoffResponse()

    async def StreamActions(
        self,
        request: pb.StreamActionsRequest,
        context: grpc.aio.ServicerContext[pb.StreamActionsRequest, pb.Action],
    ) -> AsyncIterator[pb.Action]:
        outlet = self.outlets[request.engine_id] = Outlet(wrap=False)
        await context.send_initial_metadata(())
        try:
            async for message in outlet.drain(self.linger_s):
                assert isinstance(message, pb.Action)
                yield message
        finally:
            self.outlets.pop(request.engine_id, None)

    async def Connect(
        self,
        request_iterator: AsyncIterator[pb.ConnectRequest],
        context: grpc.aio.ServicerContext[pb.ConnectRequest, pb.ConnectResponse],
    ) -> AsyncIterator[pb.ConnectResponse]:
        hello = (await anext(aiter(request_iterator))).hello
        engine_id = hello.engine_id
        outlet = self.outlets[engine_id] = Outlet(wrap=True, batch=hello.batch)
        reader = asyncio.create_task(self._read(request_iterator, outlet))
        await context.send_initial_metadata(())
        try:
            async for message in outlet.drain(self.linger_s):
                if message is END:
                    return
                assert isinstance(message, pb.ConnectResponse)
                yield message
        finally:
            reader.cancel()
            self.outlets.pop(engine_id, None)

    async def _read(self, requests: AsyncIterator[pb.ConnectRequest], outlet: Outlet) -> None:
        async for request in requests:
            for report in reports_of(request):
                outlet.push_ack(pb.ConnectAck(request_id=report.request_id))
                if report.HasField("fact"):
                    self._after_fact(report.fact)
                elif report.HasField("outcome"):
                    self._after_outcome(report.outcome)
        # The engine half-closed: ending the response stream ends the call.
        outlet.end()


END = pb.ConnectResponse()  # sentinel: never sent, ends the Connect response stream


async def serve(host: str, port: int, linger_s: float) -> None:
    server = grpc.aio.server()
    # Registered by name as the service's are (service/methods.py).
    handlers = methods.coordinator_handlers(Floor(linger_s))
    methods.register(server, methods.COORDINATOR.full_name, handlers)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    # The same line `handoff serve` logs, so one parser finds either's port.
    print(f"serving gRPC on {host}:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the empty-handler floor.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--event-loop", default="asyncio", choices=("asyncio", "uvloop"))
    parser.add_argument(
        "--stream-linger-ms",
        type=float,
        default=float(os.environ.get(LINGER_VARIABLE, Settings().stream_linger_ms)),
        help=f"as the service's setting (default: ${LINGER_VARIABLE}, else the service's default)",
    )
    args = parser.parse_args()
    # The same loop as the service it is compared with.
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        runner.run(serve(args.host, args.port, args.stream_linger_ms / 1000))


if __name__ == "__main__":
    main()
