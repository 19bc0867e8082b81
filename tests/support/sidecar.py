"""Scripted engines and sidecar helpers, shared by the sidecar tests and tests/sdk.

Imports only the SDK: tests/sdk runs it where the server package is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from handoff_client import (
    Action,
    ActionKind,
    Backoff,
    EngineSidecar,
    EngineType,
    Fact,
    Facts,
    HandoffClient,
    Outcome,
    OutcomeKind,
    Role,
    SidecarTransport,
    TimingMode,
    TransferTiming,
)

TIMEOUT_S = 10.0
SOURCE, DESTINATION = "prefill-0", "decode-0"
QUICK = Backoff(initial_s=0.01, max_s=0.1)

Handler = Callable[[Action, Facts], Awaitable[Outcome]]


class ScriptedEngine:
    """A healthy engine that reports its facts at once; a test replaces handlers by kind."""

    def __init__(self) -> None:
        self.calls: list[Action] = []
        self.notices: defaultdict[str, asyncio.Queue[Action]] = defaultdict(asyncio.Queue)
        self.overrides: dict[ActionKind, Handler] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def count(self, kind: ActionKind) -> int:
        return sum(1 for action in self.calls if action.kind is kind)

    def later(self, report: Coroutine[Any, Any, None]) -> None:
        """Report a fact after the handler returns, as an engine's own work would."""
        task = asyncio.create_task(report)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, action: Action, facts: Facts, default: Handler) -> Outcome:
        self.calls.append(action)
        return await self.overrides.get(action.kind, default)(action, facts)

    # The healthy answers, which overrides can fall back on.

    async def held(self, action: Action, facts: Facts) -> Outcome:
        timing = TransferTiming(TimingMode.FULL_PROMPT, 512, 131072, 50.0)
        self.later(facts.source_held(action.handoff_id, timing))
        return Outcome(OutcomeKind.SUBMITTED)

    async def reserved(self, action: Action, facts: Facts) -> Outcome:
        self.later(facts.destination_reserved(action.handoff_id, 512))
        return Outcome(OutcomeKind.ACCEPTED)

    async def moved(self, action: Action, facts: Facts) -> Outcome:
        self.later(facts.transfer_completed(action.handoff_id))
        return Outcome(OutcomeKind.SCHEDULED)

    # The Engine protocol.

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, self.held)

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, self.reserved)

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, self.moved)

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, applied)

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, applied)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, applied)

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._run(action, facts, applied)

    async def complete(self, action: Action) -> None:
        self.notices[action.handoff_id].put_nowait(action)


async def applied(action: Action, facts: Facts) -> Outcome:
    return Outcome(OutcomeKind.APPLIED)


class WatchedTransport:
    """The real transport, plus hooks a test can wait on.

    ``hold_first_outcome`` keeps the first outcome report from reaching the
    server until ``release`` is set, so the action stays outstanding.
    ``redelivered`` is set once the sidecar has dispatched an action with
    attempt > 1 (the code after a yield runs when the consumer asks for more).
    ``outcome_sent`` is set when an outcome report is handed to the inner
    transport; ``ended_cleanly`` when a subscription ends without an error.
    """

    def __init__(self, inner: SidecarTransport, *, hold_first_outcome: bool = False) -> None:
        self.inner = inner
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.redelivered = asyncio.Event()
        self.outcome_sent = asyncio.Event()
        self.ended_cleanly = asyncio.Event()
        self.yielded: defaultdict[ActionKind, int] = defaultdict(int)
        self.yielded_event: dict[tuple[ActionKind, int], asyncio.Event] = defaultdict(asyncio.Event)
        self._hold = hold_first_outcome

    def subscribe(
        self,
        engine_id: str,
        on_subscribed: Callable[[], None],
        *,
        incarnation: str,
        session_id: str,
    ) -> AsyncGenerator[Action, None]:
        inner = self.inner.subscribe(
            engine_id, on_subscribed, incarnation=incarnation, session_id=session_id
        )
        return self._subscribe(inner)

    async def _subscribe(self, inner: AsyncGenerator[Action, None]) -> AsyncGenerator[Action, None]:
        async with contextlib.aclosing(inner) as actions:
            async for action in actions:
                self.yielded[action.kind] += 1
                self.yielded_event[(action.kind, self.yielded[action.kind])].set()
                yield action
                if action.attempt > 1:
                    self.redelivered.set()
        self.ended_cleanly.set()

    async def report_fact(self, handoff_id: str, fact: Fact) -> None:
        await self.inner.report_fact(handoff_id, fact)

    async def report_outcome(self, handoff_id: str, action_id: int, outcome: Outcome) -> None:
        if self._hold:
            self._hold = False
            self.holding.set()
            await self.release.wait()
        self.outcome_sent.set()
        await self.inner.report_outcome(handoff_id, action_id, outcome)


@contextlib.asynccontextmanager
async def running(
    connection: HandoffClient | SidecarTransport,
    engine_id: str,
    engine: ScriptedEngine,
    **options: Any,
) -> AsyncIterator[EngineSidecar]:
    sidecar = EngineSidecar(connection, engine_id, engine, reconnect_backoff=QUICK, **options)
    async with sidecar:
        async with asyncio.timeout(TIMEOUT_S):
            await sidecar.wait_subscribed()
        yield sidecar


async def start(client: HandoffClient, stack: EngineType = EngineType.VLLM) -> str:
    handoff_id = str(uuid.uuid4())
    await client.start_handoff(
        handoff_id,
        engine_type=stack,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
        # vLLM's decode pulls the KV; SGLang's prefill pushes it.
        transfer_executor=Role.DESTINATION if stack is EngineType.VLLM else Role.SOURCE,
    )
    return handoff_id


def holding_prefill() -> tuple[ScriptedEngine, asyncio.Event]:
    """A prefill that answers SUBMITTED and never reports SourceHeld: it holds."""
    engine, submitted = ScriptedEngine(), asyncio.Event()

    async def submit(action: Action, facts: Facts) -> Outcome:
        submitted.set()
        return Outcome(OutcomeKind.SUBMITTED)

    engine.overrides[ActionKind.SUBMIT_PREFILL] = submit
    return engine, submitted
