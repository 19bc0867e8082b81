"""The committed stubs must be exactly what proto/ generates."""

from __future__ import annotations

from handoff_server.commands.stubs import drifted


def test_committed_stubs_match_the_proto() -> None:
    assert drifted() == [], "run `make stubs` and commit the result"
