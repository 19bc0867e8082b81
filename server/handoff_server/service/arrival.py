"""A call's first message, awaited within a deadline from the call's arrival.

Every handler in front of the service and health is registered as a
streaming one, so that it runs when a call arrives rather than when its
message does: the call is counted at once (:class:`quotas.Budget`), and one
that sends headers and nothing else is ended instead of holding a slot.
A call refused before its first message is read has that message read
first, so that the refusal is what its caller sees (an evicted call is not
waited for: evictions shed calls that send nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from handoff_server.service.quotas import Slot

Context = grpc.aio.ServicerContext[Any, Any]
Request = TypeVar("Request")


async def first_message(
    requests: AsyncIterator[Request],
    context: Context,
    slot: Slot,
    within_s: float,
    *,
    what: str,
    setting: str,
    refused: Callable[[grpc.StatusCode], None] = lambda code: None,
) -> Request:
    """The call's first message, which must come within ``within_s`` of its
    arrival; its ``slot`` then counts as a call with a message. Ends the call
    when it does not come in time, or the slot is evicted for a newer arrival."""
    try:
        async with asyncio.timeout(within_s) as deadline:
            slot.on_evict = lambda: deadline.reschedule(asyncio.get_running_loop().time())
            request = await anext(aiter(requests), None)
    except TimeoutError:
        if slot.evicted:
            refused(grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, slot.budget.eviction())
        refused(grpc.StatusCode.DEADLINE_EXCEEDED)
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{what}: no request within {within_s:g} s ({setting})",
        )
    if request is None:
        refused(grpc.StatusCode.INVALID_ARGUMENT)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: no request sent")
    slot.arrived()
    return request


# How long a refused call's first message is waited for: a client writes it
# as soon as its headers are out, so this bounds only callers that send none.
# What is read is at most max_message_bytes (64 KiB by default), about what
# HTTP/2's flow control lets a stream send before anything reads it.
REFUSAL_READ_S = 1.0


async def read_before_refusal(requests: AsyncIterator[Any]) -> None:
    """Take a refused call's first message, if it comes within
    :data:`REFUSAL_READ_S`, before the refusal is sent.

    gRPC's asyncio client loses the server's status when its write of a
    stream's first message (Connect's hello) fails because the call already
    ended: the caller sees INTERNAL "Internal error from Core" instead of,
    say, UNAUTHENTICATED (grpc/grpc issue 36066). Once the server has read
    that message, the client's write has completed and cannot fail.
    """
    with contextlib.suppress(TimeoutError, grpc.RpcError):
        async with asyncio.timeout(REFUSAL_READ_S):
            await anext(aiter(requests), None)
