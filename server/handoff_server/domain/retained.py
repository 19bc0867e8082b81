"""Completed handoffs as the registry keeps them: a Retained handoff, and the
plain record the registry's table holds it as.

A server keeps up to max_retained completed handoffs for retention_s, so
each must cost little memory and, since the registry's table lives as long
as the server, nothing for the cyclic garbage collector to walk. Callers
read the table through :class:`Handoffs`, which gives a record back as a
Retained; a call that may change a retained handoff runs on its unpacked
Entry.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from handoff_server.domain.entries import ONLY_SUCCEEDED, Entry, Routed
from handoff_server.domain.model import (
    SUCCEEDED_END,
    ActionKind,
    EndCause,
    EndReason,
    LostCause,
    Role,
)
from handoff_server.domain.packing import Completed, pack

# Why a handoff ended, in plain values: EndReason's fields, enums by value.
ReasonRecord = tuple[str, str | None, str, str | None, str | None, str]

# A retained handoff as the registry's table keeps it (Retained.record): a
# plain tuple of strings, numbers and bytes. The cyclic garbage collector
# stops tracking such a tuple at its first collection, so a full collection
# does not walk the max_retained of them, and the loop stalls for ms instead
# of tens of ms (bench/RESULTS.md). Its fields: the handoff's id, its
# completion time (the retention's expiry reads it), the core's fallback
# delay and ending number (packing), both engines' ids, the transfer
# executor's role, the trace (None unless tracing is on), the caller's trace
# context, the reasons, and the times as Retained keeps them.
RetainedRecord = tuple[
    str,
    float,
    float,
    int,
    str,
    str,
    str,
    object,
    tuple[tuple[str, str], ...],
    tuple[ReasonRecord, ...],
    bytes,
]


class Retained:
    """A completed handoff, kept for late reports, GetHandoff and id reuse checks.

    The registry's table holds it as a :data:`RetainedRecord` (:meth:`record`)
    and reads it back as one of these: a packed core, names shared with every
    other handoff of its engines, and its times as one bytes object, about a
    fifth of an Entry. A call that reaches it runs on an unpacked Entry (see
    unpack).
    """

    __slots__ = (
        "core",
        "source_engine_id",
        "destination_engine_id",
        "transfer_executor",
        "trace",
        "trace_context",
        "reasons",
        "_times",
    )

    # Nothing is outstanding once complete; read by bindings.authorize_report.
    routed: ClassVar[Mapping[int, Routed]] = MappingProxyType({})
    abandoned_at: ClassVar[None] = None

    def __init__(self, entry: Entry) -> None:
        assert entry.completed_at is not None
        self.core: Completed = pack(entry.core)
        self.source_engine_id = entry.source_engine_id
        self.destination_engine_id = entry.destination_engine_id
        self.transfer_executor = entry.transfer_executor
        self.trace = entry.trace
        self.trace_context = entry.trace_context
        self.reasons = entry.reasons
        times = (
            entry.started_at,
            entry.deadline,
            entry.completed_at,
            entry.timeout_s,
            *entry.lifecycle_at,
        )
        self._times = array("d", times).tobytes()

    @classmethod
    def restored(
        cls,
        core: Completed,
        source_engine_id: str,
        destination_engine_id: str,
        transfer_executor: Role,
        trace_context: tuple[tuple[str, str], ...],
        times: list[float],
        reasons: tuple[EndReason, ...] = (),
    ) -> Retained:
        """One as a journal snapshot kept it (recovery): ``times`` are its start,
        deadline, completion, timeout and lifecycle times, in that order."""
        return cls._of(
            core,
            source_engine_id,
            destination_engine_id,
            transfer_executor,
            None,
            trace_context,
            reasons,
            array("d", times).tobytes(),
        )

    @classmethod
    def _of(
        cls,
        core: Completed,
        source_engine_id: str,
        destination_engine_id: str,
        transfer_executor: Role,
        trace: object,
        trace_context: tuple[tuple[str, str], ...],
        reasons: tuple[EndReason, ...],
        times: bytes,
    ) -> Retained:
        retained = cls.__new__(cls)
        retained.core = core
        retained.source_engine_id = source_engine_id
        retained.destination_engine_id = destination_engine_id
        retained.transfer_executor = transfer_executor
        retained.trace = trace
        retained.trace_context = trace_context
        retained.reasons = reasons
        retained._times = times
        return retained

    def record(self) -> RetainedRecord:
        """This handoff as the registry's table keeps it."""
        core = self.core
        return (
            core.handoff_id,
            self.completed_at,
            core.fallback_transfer_delay_ms,
            core.ending_number,
            self.source_engine_id,
            self.destination_engine_id,
            self.transfer_executor.value,
            self.trace,
            self.trace_context,
            SUCCEEDED_RECORD
            if self.reasons is ONLY_SUCCEEDED
            else tuple(map(reason_record, self.reasons)),
            self._times,
        )

    @classmethod
    def from_record(cls, record: RetainedRecord) -> Retained:
        """The retained handoff :meth:`record` was taken from, equal to it."""
        (
            handoff_id,
            _,
            fallback,
            ending_number,
            source,
            destination,
            executor,
            trace,
            context,
            reasons,
            times,
        ) = record
        return cls._of(
            Completed(handoff_id, fallback, ending_number),
            source,
            destination,
            Role(executor),
            trace,
            context,
            reasons_of(reasons),
            times,
        )

    @property
    def handoff_id(self) -> str:
        return self.core.handoff_id

    @property
    def started_at(self) -> float:
        return array("d", self._times)[0]

    @property
    def deadline(self) -> float:
        return array("d", self._times)[1]

    @property
    def completed_at(self) -> float:
        return array("d", self._times)[2]

    @property
    def timeout_s(self) -> float:
        return array("d", self._times)[3]

    @property
    def ended_at(self) -> float:
        return self.completed_at

    @property
    def lifecycle_at(self) -> list[float]:
        return array("d", self._times)[4:].tolist()

    def unpack(self) -> Entry:
        """The full Entry again, for a call that may change the handoff."""
        entry = Entry(
            self.core.unpack(),
            self.source_engine_id,
            self.destination_engine_id,
            self.transfer_executor,
            self.timeout_s,
            self.started_at,
            self.deadline,
        )
        entry.completed_at = self.completed_at
        entry.lifecycle_at = self.lifecycle_at
        entry.trace = self.trace
        entry.trace_context = self.trace_context
        entry.reasons = self.reasons
        return entry


def reason_record(reason: EndReason) -> ReasonRecord:
    """``reason`` in plain values (a retained record, the journal)."""
    return (
        reason.cause.value,
        None if reason.role is None else reason.role.value,
        reason.engine_id,
        None if reason.lost_cause is None else reason.lost_cause.value,
        None if reason.action is None else reason.action.value,
        reason.detail,
    )


def reasons_of(records: Iterable[Sequence[Any]]) -> tuple[EndReason, ...]:
    """The reasons :func:`reason_record` wrote, the usual ones shared."""
    reasons = tuple(
        EndReason(
            EndCause(cause),
            None if role is None else Role(role),
            sys.intern(engine_id),
            None if lost is None else LostCause(lost),
            None if action is None else ActionKind(action),
            detail,
        )
        for cause, role, engine_id, lost, action, detail in records
    )
    return ONLY_SUCCEEDED if reasons == ONLY_SUCCEEDED else reasons


SUCCEEDED_RECORD = (reason_record(SUCCEEDED_END),)  # the usual reasons, one tuple for all


class Handoffs(Mapping[str, "Entry | Retained"]):
    """The registry's table as its readers see it: a retained handoff's
    record read back as a :class:`Retained`. Read-only; the registry and the
    retention change the table itself."""

    __slots__ = ("_table",)

    def __init__(self, table: dict[str, Entry | RetainedRecord]) -> None:
        self._table = table

    def __getitem__(self, handoff_id: str) -> Entry | Retained:
        return readable(self._table[handoff_id])

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


def readable(kept: Entry | RetainedRecord) -> Entry | Retained:
    """What the table keeps under an id, as a call reads it."""
    return kept if isinstance(kept, Entry) else Retained.from_record(kept)
