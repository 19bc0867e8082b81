"""Who may report what: which engines of a handoff may make each kind of report.

A rule of the domain, beside its vocabulary: a role proves only what it can
see (the source its hold, the destination its reservation, the transfer's
executor the transfer), and a caller bound to no engine (a frontend) reports
only what it can know. How a caller is identified (certificates mapped to
engines) is service/security.py's; it calls :func:`check` inside the same
synchronous step that changes the handoff, so nothing changes in between.
"""

from __future__ import annotations

from handoff_server.domain.entries import Entry, Retained
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


def check(
    caller: str,
    engines: frozenset[str],
    entry: Entry | Retained,
    *,
    fact: Fact | None = None,
    action_id: int | None = None,
) -> None:
    """May ``caller``, acting for ``engines`` (none: a frontend), report ``fact``
    or the outcome of ``action_id`` in ``entry``? Raises PermissionDenied if not.

    An engine reports only for handoffs it takes part in, outcomes only of
    actions addressed to it, and only the facts its role proves.
    """
    if not engines:
        if action_id is None and not isinstance(fact, ENGINE_ONLY):
            return
        what = "outcomes" if action_id is not None else f"{type(fact).__name__}"
        raise PermissionDenied(f"{caller} is bound to no engine; only engines report {what}")
    if not engines & {entry.source_engine_id, entry.destination_engine_id}:
        raise PermissionDenied(f"{caller} acts for no engine of this handoff")
    if action_id is not None:
        routed = entry.routed.get(action_id)
        if routed is not None and not engines.intersection(routed.engines):
            raise PermissionDenied(
                f"action {action_id} is addressed to {', '.join(routed.engines)}, not to {caller}"
            )
        return
    allowed = reporters(entry, fact)
    if not engines & allowed:
        name = type(fact).__name__
        who = ", ".join(sorted(allowed)) or "no engine (the frontend's or the server's to report)"
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
