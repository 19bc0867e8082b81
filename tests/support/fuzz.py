"""Fuzzing helpers: well-formed requests with arbitrary field values, sent to a real server.

Messages are built from the proto descriptors, so every field of every
request is covered, including ones added later. Values come from a
:class:`Source`: Hypothesis draws (for the property tests) or a seeded
``random.Random`` (for the memory test, which needs thousands of calls).
Both lean towards values the server knows (live handoff ids, in another
case; engine ids) so that fuzzed calls reach deep into the state machine
instead of stopping at the first validation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.service import convert
from handoff_server.service.app import Server

T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["HandoffCoordinator"]
METHODS = {method.name: method for method in SERVICE.methods}
PREFIX = f"/{SERVICE.full_name}/"
# Answers a fuzzed call may get. INTERNAL and UNKNOWN never: they mean a bug.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
REFUSAL_NUMBERS = frozenset(code.value[0] for code in REFUSALS)
EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 5e-324, 1e-9, 1e9, 1e308, math.inf, -math.inf, math.nan)
EDGE_INTS = (0, 1, 2, 3, 4, 5, 255, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1)
INT_RANGES = {
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),
}


class Source(Protocol):
    def choice(self, options: Sequence[T]) -> T: ...
    def integer(self, low: int, high: int) -> int: ...
    def real(self) -> float: ...
    def text(self, max_size: int) -> str: ...
    def raw(self, max_size: int) -> bytes: ...


class DrawSource:
    """Values drawn by Hypothesis, which shrinks failures to a minimal call."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def choice(self, options: Sequence[T]) -> T:
        return self.data.draw(st.sampled_from(options))

    def integer(self, low: int, high: int) -> int:
        return self.data.draw(st.integers(low, high))

    def real(self) -> float:
        return self.data.draw(st.floats())

    def text(self, max_size: int) -> str:
        return self.data.draw(st.text(max_size=max_size))

    def raw(self, max_size: int) -> bytes:
        return self.data.draw(st.binary(max_size=max_size))


class RandomSource:
    """The same kinds of values from a seeded generator: cheap, for long bursts."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def real(self) -> float:
        if self.rng.random() < 0.5:
            return self.choice(EDGE_FLOATS)
        return self.rng.uniform(-1e6, 1e6)

    def text(self, max_size: int) -> str:
        size = self.rng.randint(0, max_size)
        return "".join(
            chr(self.rng.choice((self.rng.randint(32, 126), 0x2603, 0))) for _ in range(size)
        )

    def raw(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_size))


@dataclass
class Known:
    """Values the server knows, mixed into the fuzz so that calls get past validation.

    The fuzzer aims only at ``handoff_ids``, which stay fixed: Hypothesis
    replays an example to shrink it, and its draws must not depend on what
    the server answered the first time. Handoffs the fuzzer manages to start
    are recorded in ``started``.
    """

    handoff_ids: list[str] = field(default_factory=list)
    engine_ids: list[str] = field(default_factory=lambda: ["fz-src", "fz-dst", "fz-other"])
    started: list[str] = field(default_factory=list)


class Fuzzer:
    def __init__(self, source: Source, known: Known) -> None:
        self.source = source
        self.known = known

    def string(self, name: str) -> str:
        s = self.source
        kind = s.integer(0, 9)
        if name.endswith("handoff_id") and kind < 5 and self.known.handoff_ids:
            known = s.choice(self.known.handoff_ids)
            if kind < 4:
                return known
            return s.choice((known.upper(), known.replace("-", ""), "{" + known + "}"))
        if name.endswith("engine_id") and kind < 6:
            return s.choice(self.known.engine_ids)
        if kind < 7:
            return str(uuid.UUID(int=s.integer(0, 2**128 - 1)))
        if kind < 8:
            return s.choice(("", " ", "a" * 129, "a" * 128, "x" * 1025, "\x00", "é" * 600))
        return s.text(40)

    def scalar(self, descriptor: FieldDescriptor) -> Any:
        s = self.source
        kind = descriptor.type
        if kind == FieldDescriptor.TYPE_STRING:
            return self.string(descriptor.name)
        if kind == FieldDescriptor.TYPE_BYTES:
            return s.raw(64)
        if kind == FieldDescriptor.TYPE_BOOL:
            return s.choice((False, True))
        if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return s.real()
        low, high = INT_RANGES[kind]
        if kind == FieldDescriptor.TYPE_ENUM and descriptor.enum_type and s.integer(0, 2):
            return s.choice([v.number for v in descriptor.enum_type.values])
        if s.integer(0, 1):
            return s.choice([v for v in EDGE_INTS if low <= v <= high])
        return s.integer(low, high)

    def message(self, descriptor: Descriptor, depth: int = 0) -> Message:
        message: Message = message_factory.GetMessageClass(descriptor)()
        chosen_in_oneof = {
            oneof.name: self.source.choice([None, *oneof.fields]) for oneof in descriptor.oneofs
        }
        for field_descriptor in descriptor.fields:
            oneof = field_descriptor.containing_oneof
            if oneof is not None and chosen_in_oneof[oneof.name] is not field_descriptor:
                continue
            if oneof is None and not self.source.integer(0, 3):
                continue  # leave some plain fields at their defaults
            if field_descriptor.type == FieldDescriptor.TYPE_MESSAGE:
                if depth < 4 and field_descriptor.message_type is not None:
                    sub = self.message(field_descriptor.message_type, depth + 1)
                    target = getattr(message, field_descriptor.name)
                    if field_descriptor.is_repeated:
                        target.add().CopyFrom(sub)
                    else:
                        target.SetInParent()  # present even when empty
                        target.CopyFrom(sub)
                continue
            value = self.scalar(field_descriptor)
            if field_descriptor.is_repeated:
                getattr(message, field_descriptor.name).append(value)
            else:
                setattr(message, field_descriptor.name, value)
        return message

    def request(self, method: str) -> Message:
        """Half the time a message built field by field; otherwise a valid
        request with one or two fields set to arbitrary values, which gets
        much further past validation."""
        if not self.source.integer(0, 1):
            return self.message(METHODS[method].input_type)
        message = self.template(method)
        for _ in range(self.source.integer(0, 2)):
            self.mutate(message)
        return message

    def template(self, method: str) -> Message:
        s = self.source
        handoff_id = s.choice(self.known.handoff_ids) if self.known.handoff_ids else ""
        engine_id = s.choice(self.known.engine_ids)
        if method == "StartHandoff":
            start = pb.StartHandoffRequest(
                handoff_id=str(uuid.UUID(int=s.integer(0, 2**128 - 1))),
                engine_type=s.choice(
                    (pb.ENGINE_TYPE_VLLM, pb.ENGINE_TYPE_SGLANG, pb.ENGINE_TYPE_TRTLLM)
                ),
                source_engine_id=engine_id,
                destination_engine_id=s.choice(self.known.engine_ids),
                fallback_transfer_delay_ms=s.choice((0.0, 1.0, 5.0)),
            )
            if s.integer(0, 1):
                start.timeout_s = s.choice((0.5, 30.0, 3600.0))
            return start
        if method == "ReportFact":
            return pb.ReportFactRequest(handoff_id=handoff_id, fact=self.fact())
        if method == "ReportOutcome":
            return pb.ReportOutcomeRequest(
                handoff_id=handoff_id, action_id=s.integer(0, 8), outcome=self.outcome()
            )
        if method == "GetHandoff":
            return pb.GetHandoffRequest(handoff_id=handoff_id)
        if method == "GetShardMap":
            return pb.GetShardMapRequest()
        if method == "StreamActions":
            return pb.StreamActionsRequest(engine_id=engine_id)
        if method == "Reconcile":
            sides = [
                pb.HeldSide(
                    handoff_id=handoff_id, role=s.choice((pb.ROLE_SOURCE, pb.ROLE_DESTINATION))
                )
                for _ in range(s.integer(0, 3))
            ]
            split = s.integer(0, len(sides))
            return pb.ReconcileRequest(engine_id=engine_id, held=sides[:split], freed=sides[split:])
        kind = s.choice(("hello", "fact", "outcome"))
        if kind == "hello":
            return pb.ConnectRequest(hello=pb.ConnectHello(engine_id=engine_id))
        request_id = s.integer(0, 2**64 - 1)
        if kind == "fact":
            fact = pb.ReportFactRequest(handoff_id=handoff_id, fact=self.fact())
            return pb.ConnectRequest(request_id=request_id, fact=fact)
        outcome = pb.ReportOutcomeRequest(
            handoff_id=handoff_id, action_id=s.integer(0, 8), outcome=self.outcome()
        )
        return pb.ConnectRequest(request_id=request_id, outcome=outcome)

    def fact(self) -> pb.Fact:
        s = self.source
        kind = s.choice([f.name for f in pb.Fact.DESCRIPTOR.oneofs_by_name["kind"].fields])
        fact = pb.Fact()
        if kind == "source_held":
            timing = fact.source_held.transfer_timing
            timing.mode = s.choice(
                (pb.TRANSFER_TIMING_MODE_FULL_PROMPT, pb.TRANSFER_TIMING_MODE_DESTINATION_MISSING)
            )
            timing.full_prompt_tokens = s.integer(0, 100_000)
            if s.integer(0, 1):
                timing.kv_bytes_per_token = s.integer(0, 1 << 20)
                timing.bandwidth_gb_s = s.choice((0.0, 1.0, 50.0))
        elif kind == "destination_reserved":
            fact.destination_reserved.transferable_prompt_tokens = s.integer(0, 100_000)
        else:
            getattr(fact, kind).SetInParent()
        return fact

    def outcome(self) -> pb.Outcome:
        kind = self.source.choice(pb.OutcomeKind.values()[1:])
        return pb.Outcome(kind=kind, reason="broke" if kind == pb.OUTCOME_KIND_FAILED else "")

    def mutate(self, message: Message) -> None:
        """Set one field, anywhere in the message, to an arbitrary value."""
        s = self.source
        while True:
            # Typed as a union of the upb and pure-Python descriptors.
            fields = list(cast(Sequence[FieldDescriptor], message.DESCRIPTOR.fields))
            chosen = s.choice(fields)
            if chosen.type != FieldDescriptor.TYPE_MESSAGE or chosen.is_repeated:
                break
            sub = getattr(message, chosen.name)
            present = message.HasField(chosen.name)
            if not present or not sub.DESCRIPTOR.fields or not s.integer(0, 3):
                if chosen.message_type is not None:
                    sub.CopyFrom(self.message(chosen.message_type, depth=2))
                    sub.SetInParent()
                return
            message = sub  # go deeper
        if chosen.is_repeated:
            return
        setattr(message, chosen.name, self.scalar(chosen))


@dataclass
class Tally:
    """What the fuzzed calls came to, for the final checks."""

    calls: int = 0
    accepted_starts: int = 0
    codes: dict[str, int] = field(default_factory=dict)

    def saw(self, code: grpc.StatusCode | int | str) -> None:
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self.codes[name] = self.codes.get(name, 0) + 1


def snapshot(server: Server, exclude_engines: frozenset[str]) -> dict[str, bytes]:
    """Every handoff the fuzzer can reach, as bytes, for before/after comparisons.

    Handoffs whose deadline is near are left out: the server may time them
    out by itself while a call is in flight, which is a change no call made.
    """
    horizon = server.clock() + 60.0
    return {
        handoff_id: convert.handoff(entry).SerializeToString(deterministic=True)
        for handoff_id, entry in server.registry.handoffs.items()
        if entry.deadline > horizon
        and entry.source_engine_id not in exclude_engines
        and entry.destination_engine_id not in exclude_engines
    }


def _client_write_failed(debug_error_string: str) -> bool:
    return 'Failed "execute_batch"' in debug_error_string and "SendMessageOperation" in (
        debug_error_string
    )


async def _requests(messages: Sequence[Message | bytes]) -> AsyncIterator[Message | bytes]:
    for message in messages:
        yield message


class Caller:
    """Sends fuzzed calls over one channel and checks each answer."""

    def __init__(self, channel: grpc.aio.Channel, server: Server, tally: Tally) -> None:
        self.channel = channel
        self.server = server
        self.tally = tally

    def _multi(self, method: str, raw: bool) -> Any:
        descriptor = METHODS[method]
        serialize = None if raw else (lambda m: m.SerializeToString())
        deserialize = None if raw else (lambda b: b)
        path = PREFIX + method
        if descriptor.client_streaming:
            return self.channel.stream_stream(path, serialize, deserialize)
        if descriptor.server_streaming:
            return self.channel.unary_stream(path, serialize, deserialize)
        return self.channel.unary_unary(path, serialize, deserialize)

    async def unary(self, method: str, request: Message | bytes) -> bytes | None:
        """One unary call: the answer's bytes when it was accepted, else None."""
        self.tally.calls += 1
        try:
            answer = await self._multi(method, isinstance(request, bytes))(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            code = error.code()
            details = error.details()
        else:
            self.tally.saw(grpc.StatusCode.OK)
            assert isinstance(answer, bytes)
            return answer
        assert code in REFUSALS, f"{method}: {code} {details}"
        self.tally.saw(code)
        return None

    async def stream_actions(self, request: Message | bytes) -> bool:
        """Subscribes (or is refused); a subscription is ended once confirmed.

        True when it subscribed: a new incarnation (garbage can decode as one)
        then legitimately loses the handoffs the engine's previous one held."""
        self.tally.calls += 1
        call = self._multi("StreamActions", isinstance(request, bytes))(request, timeout=10)
        await call.initial_metadata()
        call.cancel()
        code = await call.code()
        assert code in REFUSALS | {grpc.StatusCode.CANCELLED, grpc.StatusCode.OK}, (
            f"StreamActions: {code} {await call.details()}"
        )
        self.tally.saw(code)
        return code not in REFUSALS

    async def connect(self, requests: Sequence[Message | bytes]) -> bool:
        """A whole Connect stream, half-closed after ``requests``; True when
        some report was accepted (so the handoffs may legitimately change)."""
        self.tally.calls += 1
        raw = any(isinstance(r, bytes) for r in requests)
        if raw:
            requests = [r if isinstance(r, bytes) else r.SerializeToString() for r in requests]
        call = self._multi("Connect", raw)(_requests(requests), timeout=10)
        accepted = False
        with contextlib.suppress(grpc.aio.AioRpcError):  # a refusal; its code is checked below
            async for data in call:
                response = pb.ConnectResponse.FromString(data)
                if response.WhichOneof("kind") == "ack":
                    ack = response.ack
                    assert ack.code == 0 or ack.code in REFUSAL_NUMBERS, f"Connect ack: {ack}"
                    accepted |= ack.code == 0
                    self.tally.saw(ack.code)
        code = await call.code()
        if code is grpc.StatusCode.INTERNAL and _client_write_failed(
            await call.debug_error_string()
        ):
            # The server ended the stream while this client was still writing,
            # and grpc.aio's client replaced the server's status with its own
            # INTERNAL (grpc/grpc#36066). The server's answer cannot be seen
            # here, nor the acks it wrote before it (a loaded machine delivers
            # them late): the reports may have been accepted, so the handoffs
            # may have changed. The tests check the server's logs instead.
            self.tally.saw("client INTERNAL (grpc#36066)")
            return True
        assert code in REFUSALS | {grpc.StatusCode.OK}, f"Connect: {code} {await call.details()}"
        return accepted


UNARY = ("StartHandoff", "ReportFact", "ReportOutcome", "GetHandoff")
STEP_KINDS = (*UNARY, "StreamActions", "Connect", "raw")


async def fuzz_step(
    fuzzer: Fuzzer,
    caller: Caller,
    exclude_engines: frozenset[str],
    check_unchanged: bool = True,
) -> None:
    """One fuzzed call of any kind, checked: never INTERNAL or UNKNOWN, and
    (with ``check_unchanged``) a refused call leaves every handoff exactly as
    it was."""
    s = fuzzer.source
    kind = s.choice(STEP_KINDS)
    before = snapshot(caller.server, exclude_engines) if check_unchanged else {}
    accepted = False
    if kind in UNARY:
        answer = await caller.unary(kind, fuzzer.request(kind))
        accepted = answer is not None
        if kind == "StartHandoff" and answer is not None:
            caller.tally.accepted_starts += 1
            started = pb.StartHandoffResponse.FromString(answer).handoff.handoff_id
            fuzzer.known.started.append(started)
    elif kind == "StreamActions":
        accepted = await caller.stream_actions(fuzzer.request(kind))
    elif kind == "Connect":
        requests: list[Message | bytes] = [fuzzer.request(kind) for _ in range(s.integer(0, 4))]
        if s.integer(0, 2):  # usually a proper hello first, so the reports get read
            engine_id = s.choice(fuzzer.known.engine_ids)
            requests.insert(0, pb.ConnectRequest(hello=pb.ConnectHello(engine_id=engine_id)))
        if not s.integer(0, 4):
            requests.insert(s.integer(0, len(requests)), s.raw(32))  # garbage mid-stream
        accepted = await caller.connect(requests)
    else:
        method = s.choice(tuple(METHODS))
        payload = s.raw(64)
        if method == "Connect":
            accepted = await caller.connect([payload])
        elif method == "StreamActions":
            accepted = await caller.stream_actions(payload)
        else:
            accepted = await caller.unary(method, payload) is not None
    if check_unchanged and not accepted:
        after = snapshot(caller.server, exclude_engines)
        assert after == before, f"a refused {kind} call changed a handoff"


async def drive_valid_handoff(
    stub: Any, source: str, destination: str, handoff_id: str | None = None
) -> str:
    """A well-behaved frontend and two engines, all unary: must always succeed."""
    handoff_id = handoff_id or str(uuid.uuid4())
    await stub.StartHandoff(
        pb.StartHandoffRequest(
            handoff_id=handoff_id,
            engine_type=pb.ENGINE_TYPE_VLLM,
            source_engine_id=source,
            destination_engine_id=destination,
            fallback_transfer_delay_ms=1.0,
        )
    )
    held = pb.Fact(
        source_held=pb.SourceHeld(
            transfer_timing=pb.TransferTiming(
                mode=pb.TRANSFER_TIMING_MODE_FULL_PROMPT, full_prompt_tokens=10
            )
        )
    )
    steps: list[tuple[int, pb.OutcomeKind.ValueType] | pb.Fact] = [
        (0, pb.OUTCOME_KIND_SUBMITTED),
        held,
        (1, pb.OUTCOME_KIND_ACCEPTED),
        pb.Fact(destination_reserved=pb.DestinationReserved(transferable_prompt_tokens=10)),
        (2, pb.OUTCOME_KIND_SCHEDULED),
        pb.Fact(transfer_completed=pb.TransferCompleted()),
        (3, pb.OUTCOME_KIND_APPLIED),
        (4, pb.OUTCOME_KIND_APPLIED),
    ]
    last: Any = None
    for step in steps:
        await asyncio.sleep(0)  # let fuzzed calls interleave between steps
        if isinstance(step, pb.Fact):
            last = await stub.ReportFact(pb.ReportFactRequest(handoff_id=handoff_id, fact=step))
        else:
            action_id, kind = step
            last = await stub.ReportOutcome(
                pb.ReportOutcomeRequest(
                    handoff_id=handoff_id, action_id=action_id, outcome=pb.Outcome(kind=kind)
                )
            )
    assert last.handoff.completion == pb.COMPLETION_SUCCESS
    return handoff_id
