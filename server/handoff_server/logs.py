"""Structured logs: every record can carry handoff_id / engine_id, as text or JSON."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

# Context fields handlers attach with `extra=`; rendered when present.
CONTEXT_FIELDS = ("handoff_id", "engine_id", "subject")


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS if hasattr(record, name)
        )
        return f"{line} [{context}]" if context else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            if hasattr(record, name):
                document[name] = getattr(record, name)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document)


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class BurstLog:
    """Like events in bursts, one line per window: the first at once and in
    full, the rest of the window as one summary line when it closes.

    Time comes from the caller (the registry's clock); :meth:`due` says when
    a summary is owed, and :meth:`flush` writes it once that time has come.
    """

    SHOWN = 3  # subjects named in a summary; the rest are only counted

    def __init__(self, logger: logging.Logger, level: int, window_s: float, what: str) -> None:
        self.logger = logger
        self.level = level
        self.window_s = window_s
        self.what = what  # "handoffs abandoned": what the summary counts
        self._opened_at: float | None = None
        self._more: list[str] = []
        self._count = 0

    def note(self, now: float, subject: str, message: str, *args: Any, **extra: Any) -> None:
        self.flush(now)
        if self._opened_at is None:
            self._opened_at = now
            self.logger.log(self.level, message, *args, extra=extra)
            return
        self._count += 1
        if len(self._more) < self.SHOWN:
            self._more.append(subject)

    def due(self) -> float | None:
        if self._opened_at is None:
            return None
        return self._opened_at + self.window_s

    def flush(self, now: float) -> None:
        due = self.due()
        if due is None or now < due:
            return
        if self._count:
            shown = ", ".join(self._more) + (", ..." if self._count > len(self._more) else "")
            self.logger.log(
                self.level,
                "%d more %s in the %g s after the first (%s)",
                self._count,
                self.what,
                self.window_s,
                shown,
            )
        self._opened_at = None
        self._more = []
        self._count = 0
