"""Structured logs: every record can carry handoff_id / engine_id, as text or JSON."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from typing import Any, TextIO

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


# What gRPC's C core writes to fd 2: "I1201 00:47:42.556517    2162 file.cc:2563] text".
NATIVE_LINE = re.compile(r"([IWEF])\d{4} [\d:.]+ +\d+ ([^\]]+)\] ?(.*)")
NATIVE_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def configure(log_format: str, level: str, *, capture_native: bool = False) -> None:
    """Every record to stderr in one format. With ``capture_native``, what
    native code (gRPC's C core) writes to stderr becomes records too, so that
    a JSON log stays all JSON."""
    stream = _capture_native_stderr() if capture_native else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _capture_native_stderr() -> TextIO:
    """Point fd 2 at a pipe whose lines a thread logs as ``grpc.core`` records;
    the process's own writes (records, Python's warnings) go to the real stderr."""
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    sys.stderr = real
    threading.Thread(target=_relay, args=(read_fd,), name="native-stderr", daemon=True).start()
    return real


def _relay(read_fd: int) -> None:
    logger = logging.getLogger("grpc.core")
    with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            text = line.rstrip()
            if not text:
                continue
            match = NATIVE_LINE.fullmatch(text)
            if match is None:
                logger.warning("%s", text)
            else:
                logger.log(NATIVE_LEVELS[match[1]], "%s (%s)", match[3], match[2])


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
