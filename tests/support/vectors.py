"""Where the conformance vectors live, and reading them.

The repository carries its own copy in tests/conformance/ (the 2,000 vectors
of the seed's semantics and the 1,500 in which an engine is lost);
HANDOFF_VECTORS_DIR points the tests at another copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from handoff_server.commands.conformance import Vector, load_vectors

ROOT = Path(__file__).resolve().parents[2]
VECTORS_DIR = Path(os.environ.get("HANDOFF_VECTORS_DIR", ROOT / "tests" / "conformance"))
VECTORS = VECTORS_DIR / "vectors.jsonl"
LOST_VECTORS = VECTORS_DIR / "vectors-lost.jsonl"


def all_vectors(path: Path = VECTORS) -> list[Vector]:
    if not path.exists():
        pytest.fail(f"conformance vectors not found at {path} (HANDOFF_VECTORS_DIR)")
    return list(load_vectors(path))
