"""The README's sidecar example, run as written against a real server: alone,
and beside stray handoffs naming the same engine ids."""

from __future__ import annotations

import asyncio
import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from handoff_client import Completion, Handoff, HandoffClient
from tests.sdk.conftest import serving

# A stray: a handoff naming the README's engine ids, started while none is connected.
from tests.support.sidecar import start as stray

README = Path(__file__).resolve().parents[2] / "README.md"
TIMEOUT_S = 20.0
# Short, so a stray handoff loses its never-connected engines within the test.
DELIVERY_TIMEOUT_S = 2.0
POLL_S = 0.05


def sidecar_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    (example,) = [block for block in blocks if "class MyEngine" in block]
    return str(example)


def readme_main() -> types.ModuleType:
    module = types.ModuleType("readme_example")
    exec(compile(sidecar_example(), str(README), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def impatient_coordinator() -> Iterator[str]:
    with serving(f"--delivery-timeout-s={DELIVERY_TIMEOUT_S}") as target:
        yield target


async def test_the_readme_sidecar_example_runs(coordinator: str) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        handoff: Handoff = await readme_main().main(coordinator)
    assert handoff.completion is Completion.SUCCESS
    assert len(handoff.lifecycle) == 6


async def completion(client: HandoffClient, handoff_id: str) -> Completion:
    """Until the handoff is complete (the server decides when, on its own clock)."""
    while (handoff := await client.get_handoff(handoff_id)).completion is None:  # noqa: ASYNC110 - polled state
        await asyncio.sleep(POLL_S)
    return handoff.completion


async def test_the_readme_example_is_not_fooled_by_stray_handoffs(
    impatient_coordinator: str,
) -> None:
    """It once printed ``None []``: decode-0 got the COMPLETE of a handoff that
    ended before it connected and took it for its own."""
    async with asyncio.timeout(TIMEOUT_S):
        async with HandoffClient(impatient_coordinator) as client:
            lost = [await stray(client) for _ in range(3)]
            for handoff_id in lost:  # their engines never came: lost
                assert await completion(client, handoff_id) is Completion.CANCELED
        handoff: Handoff = await readme_main().main(impatient_coordinator)
    assert handoff.completion is Completion.SUCCESS
    assert len(handoff.lifecycle) == 6


async def test_the_readme_example_beside_a_handoff_started_before_its_engines(
    coordinator: str,
) -> None:
    """The engines connect after that start and serve it too: its COMPLETE
    notice comes first, and is not the program's."""
    async with asyncio.timeout(TIMEOUT_S):
        async with HandoffClient(coordinator) as client:
            earlier = await stray(client)
            handoff: Handoff = await readme_main().main(coordinator)
            assert await completion(client, earlier) is Completion.SUCCESS
    assert handoff.completion is Completion.SUCCESS
    assert handoff.handoff_id != earlier
    assert len(handoff.lifecycle) == 6
