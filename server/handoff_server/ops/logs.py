"""Structured logs: every record can carry handoff_id / engine_id, as text or JSON.

Whatever a record says is bounded and escaped before it is written (see
:func:`bounded`): a message, a context field or a traceback can carry bytes a
peer chose (a header, an id), and one line must never become a peer's
megabyte nor forge a line of its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, TextIO

# Context fields handlers attach with `extra=`; rendered when present.
CONTEXT_FIELDS = ("handoff_id", "engine_id", "subject")


# A record's message, and each context field, at most this many characters
# once escaped; a traceback at most MAX_TRACEBACK_CHARS.
MAX_MESSAGE_CHARS = 1024
MAX_TRACEBACK_CHARS = 8192
# Control characters (a newline would start a forged line), and whatever
# could not be decoded: shown escaped, as Python writes them in a literal.
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffd]")


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS, *, lines: bool = False) -> str:
    """``text`` safe to log: control characters escaped (newlines kept with
    ``lines``, for a traceback), at most ``limit`` characters, saying how many
    more there were."""

    def escape(match: re.Match[str]) -> str:
        char = match[0]
        if lines and char == "\n":
            return char
        return char.encode("unicode_escape", "backslashreplace").decode("ascii")

    shown = UNPRINTABLE.sub(escape, text[: limit + 1])
    if len(shown) <= limit and len(text) <= limit:
        return shown
    return f"{shown[:limit]}... ({len(text) - limit} more characters not logged)"


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = bounded(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return bounded(super().formatException(ei), MAX_TRACEBACK_CHARS, lines=True)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{name}={bounded(str(getattr(record, name)))}"
            for name in CONTEXT_FIELDS
            if hasattr(record, name)
        )
        return f"{line} [{context}]" if context else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": bounded(record.getMessage()),
        }
        for name in CONTEXT_FIELDS:
            if hasattr(record, name):
                document[name] = bounded(str(getattr(record, name)))
        if record.exc_info:
            document["exception"] = bounded(
                self.formatException(record.exc_info), MAX_TRACEBACK_CHARS, lines=True
            )
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


# The core's sources that parse what a peer sent (HPACK, HTTP/2 frames):
# their complaints are logged at WARNING at most.
PEER_INPUT = ("hpack_parser.cc", "hpack_parse_result.cc", "parsing.cc", "frame_")
# Lines of gRPC's C core logged per second at most: a peer that makes the
# core complain on every frame must not make the log its megaphone. The rest
# of the second is counted, in one line when it is over.
NATIVE_LINES_PER_S = 20
# What one native line may weigh as read; the rest of the line is skipped.
NATIVE_LINE_BYTES = 4 * MAX_MESSAGE_CHARS


def _relay(read_fd: int) -> None:
    logger = logging.getLogger("grpc.core")
    window = NativeWindow(logger, time.monotonic)
    with os.fdopen(read_fd, "rb") as native:
        while raw := native.readline(NATIVE_LINE_BYTES):
            cut = not raw.endswith(b"\n")
            while cut and (rest := native.readline(NATIVE_LINE_BYTES)):
                cut = not rest.endswith(b"\n")  # the rest of a line too long, unread
            window.log(raw.decode("utf-8", "replace").rstrip())


class NativeWindow:
    """gRPC core's lines as records, at most NATIVE_LINES_PER_S a second."""

    def __init__(self, logger: logging.Logger, clock: Any) -> None:
        self.logger = logger
        self.clock = clock
        self.opened_at = clock()
        self.logged = 0
        self.dropped = 0

    def log(self, text: str) -> None:
        if not text:
            return
        now = self.clock()
        if now - self.opened_at >= 1.0:
            if self.dropped:
                self.logger.warning(
                    "%d more lines of gRPC's core not logged in the second after the first %d",
                    self.dropped,
                    NATIVE_LINES_PER_S,
                )
            self.opened_at, self.logged, self.dropped = now, 0, 0
        if self.logged >= NATIVE_LINES_PER_S:
            self.dropped += 1
            return
        self.logged += 1
        match = NATIVE_LINE.fullmatch(text)
        if match is None:
            self.logger.warning("%s", text)
            return
        level = NATIVE_LEVELS[match[1]]
        if match[2].startswith(PEER_INPUT):
            # A peer's malformed HTTP/2 is the peer's error, not the server's.
            level = min(level, logging.WARNING)
        self.logger.log(level, "%s (%s)", match[3], match[2])


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
