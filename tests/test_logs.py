"""Logs carry the handoff id, as text or as one JSON object per line."""

from __future__ import annotations

import json
import logging

from handoff_server.logs import JsonFormatter, TextFormatter


def record(**extra: str) -> logging.LogRecord:
    made = logging.LogRecord(
        "handoff.registry", logging.WARNING, __file__, 1, "deadline %s", ("passed",), None
    )
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def test_json_lines_carry_the_handoff_id() -> None:
    line = JsonFormatter().format(record(handoff_id="6f1c0b9e-8c1d-4e43-9a55-0d4d8f1b2a10"))
    document = json.loads(line)
    assert document["message"] == "deadline passed"
    assert document["level"] == "warning"
    assert document["handoff_id"] == "6f1c0b9e-8c1d-4e43-9a55-0d4d8f1b2a10"


def test_text_lines_carry_the_engine_id() -> None:
    line = TextFormatter().format(record(engine_id="decode-3"))
    assert line.endswith("handoff.registry: deadline passed [engine_id=decode-3]")
