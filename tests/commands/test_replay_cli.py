"""`handoff replay` reports the first mismatching step and a closing count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handoff_server.commands.cli import main
from tests.support.vectors import LOST_VECTORS, VECTORS


def test_replay_passes_every_shared_vector(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(VECTORS), str(LOST_VECTORS)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "3500 passed, 0 failed"


def test_replay_prints_the_first_mismatch_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = VECTORS.read_text().splitlines()[:3]
    broken = json.loads(lines[1])
    broken["steps"][0]["expect"]["actions"][0]["kind"] = "complete"
    broken["steps"][1]["expect"]["ok"] = False  # a later mismatch must not be reported
    lines[1] = json.dumps(broken)
    path = tmp_path / "vectors.jsonl"
    path.write_text("\n".join(lines) + "\n")

    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "2 passed, 1 failed"
    failures = [line for line in out if line.startswith("FAIL")]
    assert len(failures) == 1
    assert failures[0].startswith(f"FAIL {broken['name']} step 0 (start): expected actions")


def test_replay_rejects_a_file_that_is_not_vectors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_text('{"name": "x"}\n')
    assert main(["replay", str(path)]) == 2
    assert "not a conformance vector" in capsys.readouterr().err
