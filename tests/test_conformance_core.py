"""Every recorded handoff, replayed through the pure core."""

from __future__ import annotations

from handoff_server.conformance import run_on_core
from tests.support import all_vectors


def test_all_vectors_pass_through_the_core() -> None:
    vectors = all_vectors()
    assert len(vectors) == 2000
    failures = [str(f) for v in vectors if (f := run_on_core(v)) is not None]
    assert failures == []
