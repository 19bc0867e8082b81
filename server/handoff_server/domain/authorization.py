"""Who may act for which engine, and who may report what in a handoff.

Rules of the domain, beside its vocabulary: a caller acts only for the
engines its credentials are bound to (:class:`Binding`: subscribe, reconcile
and report as them); a role proves only what it can see (the source its
hold, the destination its reservation, the transfer's executor the
transfer), and a caller bound to no engine (a frontend) reports only what it
can know. How a caller is identified (tokens and certificates, and where
their engines are written) is service/security.py's; it calls these checks
inside the same synchronous step that changes the handoff, so nothing
changes in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from handoff_server.domain.entries import Entry
from handoff_server.domain.model import (
    Canceled,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    PermissionDenied,
    Role,
    SourceHeld,
    TimedOut,
    TransferCompleted,
)
from handoff_server.domain.retained import Retained

# The roles that may report each fact; None: the transfer's executor.
# A fact no role may report is the frontend's (or the server's own).
REPORTERS: dict[type[Fact], tuple[Role, ...] | None] = {
    SourceHeld: (Role.SOURCE,),
    DestinationReserved: (Role.DESTINATION,),
    TransferCompleted: None,
    Failed: (Role.SOURCE, Role.DESTINATION),
    Canceled: (Role.SOURCE, Role.DESTINATION),
    TimedOut: (),
    EngineLost: (),
}
# Facts that only an engine proves: a frontend cannot know them.
ENGINE_ONLY = (SourceHeld, DestinationReserved, TransferCompleted)


# Where to give a caller engine E, for its refusal: "add E to engines= ...".
Fix = Callable[[str], str]
# In a binding, an entry ending with this stands for every engine id that
# starts with what precedes it ("prefill-*"); alone, for every engine id.
WILDCARD = "*"


@dataclass(frozen=True, slots=True)
class Binding:
    """The engine ids one caller may act for: subscribe as, reconcile as and
    report for. Unbound (the default) is a frontend's: it acts for no engine.

    ``engine``: some credential of the caller names engines, so it is an
    engine's and never a frontend's, even where its credentials together
    leave it no engine (a token for one engine with a certificate for
    another): a frontend may cancel any handoff, an engine only its own.
    """

    ids: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()  # "prefill-" for "prefill-*", "" for "*"
    engine: bool = False

    @classmethod
    def of(cls, entries: Iterable[str]) -> Binding:
        """From engine ids and ``prefix*`` patterns, as a token file writes them."""
        entries = tuple(entries)
        prefixes = tuple(sorted({e[:-1] for e in entries if e.endswith(WILDCARD)}))
        ids = frozenset(e for e in entries if not e.endswith(WILDCARD))
        return cls(ids, prefixes, engine=bool(entries))

    @property
    def any_engine(self) -> bool:
        return "" in self.prefixes

    def covers(self, engine_id: str) -> bool:
        return engine_id in self.ids or engine_id.startswith(self.prefixes)

    def __and__(self, other: Binding) -> Binding:
        """The engines both bindings cover: a caller with two credentials (a
        token and a certificate) acts only where both let it."""
        ids = {e for e in self.ids if other.covers(e)} | {e for e in other.ids if self.covers(e)}
        prefixes = {
            longer
            for p in self.prefixes
            for q in other.prefixes
            for longer in (p, q)
            if longer.startswith(p) and longer.startswith(q)
        }
        return Binding(frozenset(ids), tuple(sorted(prefixes)), self.engine or other.engine)

    def __str__(self) -> str:
        shown = [*sorted(self.ids), *(p + WILDCARD for p in self.prefixes)]
        if not shown:
            return "none"
        return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


# A frontend's: no engine at all.
UNBOUND = Binding()


def check_engine(caller: str, binding: Binding, engine_id: str, fix: Fix) -> None:
    """May ``caller`` act as ``engine_id`` (StreamActions, Connect, Reconcile)?
    Raises PermissionDenied naming its engines and where to change them."""
    if not binding.covers(engine_id):
        raise PermissionDenied(
            f"{caller} may not act for engine {engine_id} (its engines: {binding}): "
            f"{fix(engine_id)}"
        )


def check(
    caller: str,
    binding: Binding,
    entry: Entry | Retained,
    fix: Fix,
    *,
    fact: Fact | None = None,
    action_id: int | None = None,
) -> None:
    """May ``caller``, acting for the engines of ``binding`` (none: a frontend),
    report ``fact`` or the outcome of ``action_id`` in ``entry``? Raises
    PermissionDenied if not; where more engines would let it (it is bound to
    none, or to none of this handoff's), naming with ``fix`` where to add one.

    An engine reports only for handoffs it takes part in, outcomes only of
    actions addressed to it, and only the facts its role proves.
    """
    engines = frozenset(
        e for e in (entry.source_engine_id, entry.destination_engine_id) if binding.covers(e)
    )
    routed = entry.routed.get(action_id) if action_id is not None else None
    needed = sorted(routed.engines if routed is not None else reporters(entry, fact))
    hint = f": {fix(needed[0])}" if needed else ""
    if not binding.engine:
        if action_id is None and not isinstance(fact, ENGINE_ONLY):
            return
        what = "outcomes" if action_id is not None else f"{type(fact).__name__}"
        raise PermissionDenied(f"{caller} is bound to no engine; only engines report {what}{hint}")
    if not engines:
        raise PermissionDenied(f"{caller} acts for no engine of this handoff{hint}")
    if action_id is not None:
        if routed is not None and not engines.intersection(routed.engines):
            raise PermissionDenied(
                f"action {action_id} is addressed to {', '.join(routed.engines)}, not to {caller}"
            )
        return
    if not engines & frozenset(needed):
        name = type(fact).__name__
        who = ", ".join(needed) or "no engine (the frontend's or the server's to report)"
        raise PermissionDenied(f"{caller} may not report {name}: only {who} may")


def reporters(entry: Entry | Retained, fact: Fact | None) -> frozenset[str]:
    """The engines of ``entry`` that may report ``fact``."""
    roles = REPORTERS.get(type(fact), ()) if fact is not None else ()
    if roles is None:
        roles = (entry.transfer_executor,)
    return frozenset(
        entry.source_engine_id if role is Role.SOURCE else entry.destination_engine_id
        for role in roles
    )
