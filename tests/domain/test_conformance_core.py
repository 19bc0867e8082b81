"""Every recorded handoff, replayed through the pure core."""

from __future__ import annotations

from pathlib import Path

import pytest

from handoff_server.commands.conformance import run_on_core
from tests.support.vectors import LOST_VECTORS, VECTORS, all_vectors


@pytest.mark.parametrize(
    ("path", "count"), [(VECTORS, 2000), (LOST_VECTORS, 1500)], ids=["vectors", "lost"]
)
def test_all_vectors_pass_through_the_core(path: Path, count: int) -> None:
    vectors = all_vectors(path)
    assert len(vectors) == count
    failures = [str(f) for v in vectors if (f := run_on_core(v)) is not None]
    assert failures == []
