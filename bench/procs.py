"""Servers under test in their own processes, and what /proc says about them.

The server runs apart from the load so its CPU time and RSS are its own:
utime + stime of every thread (gRPC's included) from /proc/PID/stat, and
VmRSS from /proc/PID/status.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"serving gRPC\b.*? on \S+:(\d+)")
METRICS = re.compile(r"serving gRPC\b.*?, metrics on \S+:(\d+)")
TICKS = os.sysconf("SC_CLK_TCK")

# The service as deployed, but bound to loopback, with no metrics port (the
# collectors still run) and a short drain so stopping is quick.
SERVICE = ["-m", "handoff_server.commands.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
SERVICE_FLAGS = ["--metrics-port", "-1", "--drain-grace-s", "1"]
FLOOR = ["-m", "bench.floor", "--host", "127.0.0.1", "--port", "0"]


class ServerProcess:
    """A server child; its output is drained by a thread (the last lines are kept)."""

    def __init__(self, args: list[str], name: str) -> None:
        self.name = name
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._port: int | None = None
        self.metrics_port: int | None = None  # once serving, if it serves metrics
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    @property
    def target(self) -> str:
        """host:port, once the server says it serves (several may start at once)."""
        if not self._found.wait(60) or self._port is None:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.tail))
        return f"127.0.0.1:{self._port}"

    @classmethod
    def service(cls, *flags: str, name: str = "service") -> ServerProcess:
        return cls([*SERVICE, *SERVICE_FLAGS, *flags], name)

    @classmethod
    def floor(cls, *flags: str) -> ServerProcess:
        return cls([*FLOOR, *flags], "floor")

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.tail.append(line)
            if self._port is None and (match := SERVING.search(line)):
                if metrics := METRICS.search(line):
                    self.metrics_port = int(metrics.group(1))
                self._port = int(match.group(1))
                self._found.set()
        self._found.set()  # exited before serving: the constructor reports the tail

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def settled_rss(self, quiet_s: float = 1.0) -> int:
        """RSS once the server has been idle a moment (timers, GC, late writes)."""
        time.sleep(quiet_s)
        return self.rss_bytes()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
