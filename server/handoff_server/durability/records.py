"""The journal's record format: what each accepted call is, as a small JSON list.

The registry hands each accepted call to a :class:`JournalRecorder` (its
``recorder``), which encodes it here; recovery.py decodes and replays. A
completed handoff is one ``retained`` record that replaces its history
(journal format 2): it was most of a full journal's records, and nothing
about it can change but a reopen. Record heads are the vocabulary's own
names (model.FACT_KINDS), so a fact is spelled once. Format 3 adds why a
handoff ended: at the end of a retained record, and of a fact's record when
the registry gave the fact a reason it does not say by itself (Explained).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from handoff_server.domain import packing
from handoff_server.domain.core import (
    Checkpoint,
    DestinationStage,
    Settlement,
    SourceStage,
    TransferStage,
)
from handoff_server.domain.entries import StartRequest
from handoff_server.domain.model import (
    UNSPECIFIED_END,
    Canceled,
    Completion,
    DestinationReserved,
    EndReason,
    EngineLost,
    Fact,
    Failed,
    LifecycleEvent,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_server.domain.packing import Completed
from handoff_server.domain.registry import Recorded
from handoff_server.domain.retained import Retained, reason_record, reasons_of
from handoff_server.durability.journal import Journal

ABANDONED = "abandoned"  # a record of its own: the cleanup timer's doing, not a call's
RETAINED = "retained"  # a completed handoff whole: it replaced the handoff's history
FORSAKEN = "forsaken"  # a side's actions that never reached its engine, owed no more
OWN_RECORDS = frozenset({RETAINED, FORSAKEN, ABANDONED})  # the server's doing, not a call's
# The facts without fields: one value each, decoded by their kind alone.
SIMPLE_FACTS: dict[str, Fact] = {
    fact.kind: fact for fact in (TransferCompleted(), Failed(), TimedOut(), Canceled())
}


# --- what a record says ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Explained:
    """A fact record that kept why it ends its handoff, beyond what the fact
    says by itself: a lost engine's cause, a drain, the caller's text."""

    fact: Fact
    reason: EndReason


def encode(call: Recorded, reason: EndReason | None = None) -> list[object]:
    """A call's record; a fact's ends with ``reason`` if the registry gave one."""
    body = _encode(call)
    if reason is not None and not isinstance(call, (tuple, StartRequest)):
        body.append(reason_record(reason))
    return body


def _encode(call: Recorded) -> list[object]:
    if isinstance(call, tuple):
        action_id, outcome = call
        return ["outcome", action_id, outcome.kind.value, outcome.reason]
    if isinstance(call, StartRequest):
        return [
            "start",
            call.order.value,
            call.source_engine_id,
            call.destination_engine_id,
            call.fallback_transfer_delay_ms,
            call.transfer_executor.value,
            call.timeout_s,
            [list(pair) for pair in call.trace_context],
        ]
    if isinstance(call, SourceHeld):
        t = call.transfer_timing
        return [
            call.kind,
            t.mode.value,
            t.full_prompt_tokens,
            t.kv_bytes_per_token,
            t.bandwidth_gb_s,
            t.state_bytes,
        ]
    if isinstance(call, DestinationReserved):
        return [call.kind, call.transferable_prompt_tokens]
    if isinstance(call, EngineLost):
        return [call.kind, call.role.value]
    return [call.kind]


def encode_retained(retained: Retained) -> list[object]:
    """A completed handoff whole, as :meth:`Registry.restore` takes it back.

    Its packed core (Completed) is all but constant: stages and settlements,
    the lifecycle, the next action id; the action journal is empty once
    complete (the core forgot it). The times are the registry's, as kept.
    """
    core = retained.core
    _, completion, lifecycle, source, destination, transfer, (next_id, issued, outcomes) = (
        core.ending.state
    )
    assert completion is not None, "only a completed core"
    assert not issued, "a completed core forgot its actions"
    assert not outcomes, "a completed core forgot its actions"
    timing = source[2]
    return [
        RETAINED,
        core.order.value,
        retained.source_engine_id,
        retained.destination_engine_id,
        core.fallback_transfer_delay_ms,
        retained.transfer_executor.value,
        [list(pair) for pair in retained.trace_context],
        [retained.started_at, retained.deadline, retained.completed_at, retained.timeout_s],
        retained.lifecycle_at,
        completion.value,
        [event.value for event in lifecycle],
        [
            source[0].value,
            source[1].value,
            None
            if timing is None
            else [
                timing.mode.value,
                timing.full_prompt_tokens,
                timing.kv_bytes_per_token,
                timing.bandwidth_gb_s,
                timing.state_bytes,
            ],
        ],
        [destination[0].value, destination[1].value, destination[2]],
        [transfer[0].value, transfer[1]],
        next_id,
        [reason_record(reason) for reason in retained.reasons],
    ]


def _reasons(body: list[list[Any]]) -> tuple[EndReason, ...]:
    """The reasons a format 3 row keeps; a format 2 row has none (unspecified)."""
    return reasons_of(body) if body else (UNSPECIFIED_END,)


ENDING_FIELDS = 6  # completion, lifecycle, source, destination, transfer, next id


def decode_retained(handoff_id: str, body: list[Any], endings: dict[str, int]) -> Retained:
    """The retained handoff a ``retained`` record was written from.

    ``endings`` caches each distinct ending by its text: a hundred thousand
    retained handoffs end in a few dozen ways, and building the enums again
    for each dominated restoring one (bench/RESULTS.md).
    """
    (_, order, source_id, destination_id, fallback, executor, trace, times, lifecycle_at, *end) = (
        body
    )
    reasons = _reasons(end.pop() if len(end) > ENDING_FIELDS else [])
    key = f"{order} {end!r}"
    number = endings.get(key)
    if number is None:
        number = endings[key] = packing.ending_number(Order(order), _ending(*end))
    return Retained.restored(
        Completed(handoff_id, fallback, number),
        sys.intern(source_id),
        sys.intern(destination_id),
        Role(executor),
        tuple((name, value) for name, value in trace),
        times + lifecycle_at,
        reasons,
    )


def _ending(
    completion: str,
    lifecycle: list[str],
    source: list[Any],
    destination: list[Any],
    transfer: list[Any],
    next_id: int,
) -> Checkpoint:
    source_stage, source_settlement, timing = source
    destination_stage, destination_settlement, tokens = destination
    return (
        Phase.COMPLETE,
        Completion(completion),
        tuple(LifecycleEvent(event) for event in lifecycle),
        (
            SourceStage(source_stage),
            Settlement(source_settlement),
            None if timing is None else TransferTiming(TimingMode(timing[0]), *timing[1:]),
        ),
        (DestinationStage(destination_stage), Settlement(destination_settlement), tokens),
        (TransferStage(transfer[0]), transfer[1]),
        (next_id, (), ()),
    )


def decode(handoff_id: str, body: list[Any]) -> Recorded | Explained:
    kind = body[0]
    if kind == "outcome":
        _, action_id, outcome_kind, reason = body
        return action_id, Outcome(OutcomeKind(outcome_kind), reason)
    if kind == "start":
        _, order, source, destination, fallback, executor, timeout_s, trace = body
        return StartRequest(
            handoff_id,
            Order(order),
            source,
            destination,
            fallback,
            Role(executor),
            timeout_s,
            tuple((key, value) for key, value in trace),
        )
    if kind == SourceHeld.kind:
        _, mode, tokens, kv_bytes, bandwidth, state_bytes = body
        return SourceHeld(
            TransferTiming(TimingMode(mode), tokens, kv_bytes, bandwidth, state_bytes)
        )
    if kind == DestinationReserved.kind:
        return DestinationReserved(body[1])
    if kind == EngineLost.kind:
        fact: Fact = EngineLost(Role(body[1]))
        fields = 2
    else:
        fact, fields = SIMPLE_FACTS[kind], 1
    if len(body) > fields:  # format 3: the reason the registry gave it
        (reason,) = _reasons(body[fields:])
        return Explained(fact, reason)
    return fact


class JournalRecorder:
    """The registry's recorder: encodes each accepted call into the journal."""

    __slots__ = ("journal",)

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def record(
        self, handoff_id: str, at: float, call: Recorded, reason: EndReason | None = None
    ) -> None:
        self.journal.append(handoff_id, at, encode(call, reason))

    def abandoned(self, handoff_id: str, at: float) -> None:
        self.journal.append(handoff_id, at, [ABANDONED])

    def completed(self, retained: Retained, at: float) -> None:
        self.journal.replace(retained.handoff_id, at, encode_retained(retained))

    def forsaken(self, handoff_id: str, at: float, role: Role, engine_id: str) -> None:
        self.journal.append(handoff_id, at, [FORSAKEN, role.value, engine_id])

    def drop(self, handoff_id: str) -> None:
        self.journal.drop(handoff_id)
