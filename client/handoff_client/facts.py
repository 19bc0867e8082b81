"""Facts: what an engine reports on its own initiative, in order behind its outcomes."""

from __future__ import annotations

from handoff_client.model import (
    Canceled,
    DestinationReserved,
    Fact,
    Failed,
    SourceHeld,
    TransferCompleted,
    TransferTiming,
)
from handoff_client.outbox import Outbox
from handoff_client.transport import SidecarTransport


class Facts:
    """What an engine reports on its own initiative.

    Each call returns once the server has the fact, after every outcome and
    fact the engine produced earlier for the same handoff. Report the fact
    that follows an action (SourceHeld after SubmitPrefill, ...) after that
    action's handler has returned, e.g. from a task the handler started.
    A final rejection raises a :class:`~handoff_client.errors.HandoffRpcError`.
    """

    def __init__(self, outbox: Outbox, transport: SidecarTransport) -> None:
        self._outbox = outbox
        self._transport = transport

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
        await self._outbox.send(handoff_id, lambda: self._transport.report_fact(handoff_id, fact))
