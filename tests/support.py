"""Shared test helpers: where the conformance vectors live, and a real
``handoff serve`` process for the tests that kill one.

The repository carries its own copy in tests/conformance/ (the 2,000 vectors
of the seed's semantics and the 1,500 in which an engine is lost);
HANDOFF_VECTORS_DIR points the tests at another copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from handoff_server.commands.conformance import Vector, load_vectors

ROOT = Path(__file__).resolve().parents[1]
VECTORS_DIR = Path(os.environ.get("HANDOFF_VECTORS_DIR", ROOT / "tests" / "conformance"))
VECTORS = VECTORS_DIR / "vectors.jsonl"
LOST_VECTORS = VECTORS_DIR / "vectors-lost.jsonl"


def all_vectors(path: Path = VECTORS) -> list[Vector]:
    if not path.exists():
        pytest.fail(f"conformance vectors not found at {path} (HANDOFF_VECTORS_DIR)")
    return list(load_vectors(path))


def serve_process(port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``handoff serve`` on loopback ``port`` in a process of its own (no metrics
    port, info logs appended to ``log``), with ``flags`` added."""
    command = [
        sys.executable,
        "-m",
        "handoff_server.commands.cli",
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--metrics-port",
        "-1",
        "--log-level",
        "info",
        *flags,
    ]
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)
