"""The README's sidecar example, run as written against a real server."""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path

from handoff_client import Completion, Handoff

README = Path(__file__).resolve().parents[2] / "README.md"
TIMEOUT_S = 10.0


def sidecar_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    (example,) = [block for block in blocks if "class MyEngine" in block]
    return str(example)


async def test_the_readme_sidecar_example_runs(coordinator: str) -> None:
    module = types.ModuleType("readme_example")
    exec(compile(sidecar_example(), str(README), "exec"), module.__dict__)
    async with asyncio.timeout(TIMEOUT_S):
        handoff: Handoff = await module.main(coordinator)
    assert handoff.completion is Completion.SUCCESS
    assert len(handoff.lifecycle) == 6
