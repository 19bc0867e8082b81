"""Facts: what an engine reports on its own initiative, in order behind its outcomes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from handoff_client.model import (
    Canceled,
    DestinationReserved,
    Fact,
    Failed,
    SourceHeld,
    TransferCompleted,
    TransferTiming,
)

# Queues a report behind the handoff's earlier ones, on the link of the shard
# that owns it; the awaitable ends when it lands.
Send = Callable[[str, Fact], Awaitable[None]]


class Facts:
    """What an engine reports on its own initiative.

    Each call returns once the server has the fact, after every outcome and
    fact the engine produced earlier for the same handoff. Report the fact
    that follows an action (SourceHeld after SubmitPrefill, ...) after that
    action's handler has returned, e.g. from a task the handler started.
    A final rejection raises a :class:`~handoff_client.errors.HandoffRpcError`.
    """

    def __init__(self, send: Send) -> None:
        self._send = send

    async def source_held(self, handoff_id: str, timing: TransferTiming) -> None:
        await self._report(handoff_id, SourceHeld(timing))

    async def destination_reserved(self, handoff_id: str, transferable_prompt_tokens: int) -> None:
        await self._report(handoff_id, DestinationReserved(transferable_prompt_tokens))

    async def transfer_completed(self, handoff_id: str) -> None:
        await self._report(handoff_id, TransferCompleted())

    async def failed(self, handoff_id: str, reason: str) -> None:
        await self._report(handoff_id, Failed(reason))

    async def canceled(self, handoff_id: str, reason: str) -> None:
        await self._report(handoff_id, Canceled(reason))

    async def _report(self, handoff_id: str, fact: Fact) -> None:
        await self._send(handoff_id, fact)
