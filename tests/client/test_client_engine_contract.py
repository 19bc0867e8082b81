"""docs/engine-contract.md's example, run as written against a real server."""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path

import pytest

from handoff_client import Completion, Handoff
from handoff_server.service.app import Server

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine-contract.md"
TIMEOUT_S = 10.0


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    (block,) = blocks  # the document's only code block
    return str(block)


async def test_the_engine_contract_example_runs(
    lean_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    module = types.ModuleType("engine_contract_example")
    exec(compile(example(), str(DOC), "exec"), module.__dict__)
    async with asyncio.timeout(TIMEOUT_S):
        handoff: Handoff = await module.main(f"127.0.0.1:{lean_server.port}")
    assert handoff.completion is Completion.SUCCESS
    assert capsys.readouterr().out.splitlines() == [
        "already started: False",
        "Completion.SUCCESS prefill holds 0 blocks",
    ]
