"""The caller's W3C trace context, as much of it as a retained handoff may keep.

A StartHandoff's ``traceparent`` and ``tracestate`` headers are kept with
the handoff (in memory and in the journal) until it is forgotten, so what a
caller sends there must cost a bounded amount per handoff: one traceparent
valid by W3C Trace Context (the only version defined, 00), and a tracestate
of at most MAX_TRACESTATE_BYTES that comes with it. Anything else is
dropped and counted; the handoff itself is never refused for it, since
tracing is best effort.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
# W3C Trace Context's own limit on what a vendor must propagate.
MAX_TRACESTATE_BYTES = 512
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_ZEROS = {"0" * 32, "0" * 16}


def valid_traceparent(value: str) -> bool:
    match = _TRACEPARENT.fullmatch(value)
    return match is not None and not ({match.group(1), match.group(2)} & _ZEROS)


def trace_context(
    metadata: Iterable[tuple[str, str | bytes]],
) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """What is kept of ``metadata``'s trace context, and the headers dropped.

    Kept: the one traceparent, if valid, and then its tracestate if it is one
    header of at most MAX_TRACESTATE_BYTES. Two traceparents, or two
    tracestates, are ambiguous: dropped."""
    parents: list[str] = []
    states: list[str] = []
    for key, value in metadata:
        if key == TRACEPARENT:
            parents.append(value if isinstance(value, str) else "")
        elif key == TRACESTATE:
            states.append(value if isinstance(value, str) else "")
    kept: list[tuple[str, str]] = []
    dropped: list[str] = []
    if parents:
        if len(parents) == 1 and valid_traceparent(parents[0]):
            kept.append((TRACEPARENT, parents[0]))
        else:
            dropped.append(TRACEPARENT)
    if states:
        if kept and len(states) == 1 and len(states[0].encode()) <= MAX_TRACESTATE_BYTES:
            kept.append((TRACESTATE, states[0]))
        else:
            dropped.append(TRACESTATE)
    return tuple(kept), dropped
