"""docs/engine-contract.md's example engine, freed by the sidecar on its own (issue 23).

The prefill of the contract's example holds its blocks (no decode is
running), then the frontend declares it lost: the COMPLETE notice frees it
through its own ``cancel_source``, with a made-up free's identity
(``action.origin`` COMPLETE, action id -1, attempt 0), never the id of one of
the handoff's real actions, which rule 1's de-duplication would skip.
"""

from __future__ import annotations

import asyncio
import types
import uuid

from handoff_client import (
    Action,
    EngineLost,
    EngineSidecar,
    EngineType,
    Facts,
    HandoffClient,
    Origin,
    Outcome,
    Role,
)
from handoff_client.model import MADE_UP_ACTION_ID
from handoff_server.service.app import Server
from tests.client.test_client_engine_contract import DOC, example
from tests.support.lease import until

TIMEOUT_S = 10.0


async def test_the_examples_prefill_is_freed_by_a_made_up_free_it_cannot_mistake(
    lean_server: Server,
) -> None:
    module = types.ModuleType("engine_contract_example")
    exec(compile(example(), str(DOC), "exec"), module.__dict__)
    frees: list[Action] = []

    class Prefill(module.Prefill):  # type: ignore[name-defined,misc]
        async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
            frees.append(action)
            outcome: Outcome = await super().cancel_source(action, facts)
            return outcome

    prefill = Prefill()
    handoff_id = str(uuid.uuid4())
    async with (
        asyncio.timeout(TIMEOUT_S),
        HandoffClient(f"127.0.0.1:{lean_server.port}") as client,
        EngineSidecar(client, "prefill-0", prefill) as sidecar,
    ):
        await sidecar.wait_subscribed()
        update = await client.start_handoff(
            handoff_id,
            engine_type=EngineType.VLLM,
            source_engine_id="prefill-0",
            destination_engine_id="decode-0",  # never connects
            transfer_executor=Role.DESTINATION,
        )
        ids = {action.id for action in update.actions}
        await until(lambda: handoff_id in prefill.blocks)
        await client.report_fact(handoff_id, EngineLost(Role.SOURCE))
        await until(lambda: bool(frees))
        await until(lambda: handoff_id not in prefill.blocks)
    (free,) = frees
    assert free.origin is Origin.COMPLETE
    assert free.id == MADE_UP_ACTION_ID
    assert free.id not in ids
    assert free.attempt == 0
    assert sidecar.stats.freed_on_complete == 1
