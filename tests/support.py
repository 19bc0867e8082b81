"""Shared test helpers: where the conformance vectors live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from handoff_server.conformance import Vector, load_vectors

ROOT = Path(__file__).resolve().parents[1]
VECTORS = Path(
    os.environ.get("HANDOFF_VECTORS", ROOT.parent / "shared" / "conformance" / "vectors.jsonl")
)


def all_vectors() -> list[Vector]:
    if not VECTORS.exists():
        pytest.fail(f"conformance vectors not found at {VECTORS} (set HANDOFF_VECTORS)")
    return list(load_vectors(VECTORS))
