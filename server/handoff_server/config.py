"""Server settings: one frozen dataclass, each field a flag and a HANDOFF_* variable.

Precedence: command-line flag, then environment variable, then the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def _setting(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = _setting("0.0.0.0", "address the gRPC server binds")
    port: int = _setting(50051, "gRPC port (0 picks a free one)")
    metrics_host: str = _setting("0.0.0.0", "address the Prometheus metrics endpoint binds")
    metrics_port: int = _setting(9464, "metrics HTTP port (0 picks a free one; -1 disables)")
    default_timeout_s: float = _setting(
        300.0, "handoff deadline when StartHandoff gives none, in seconds"
    )
    delivery_timeout_s: float = _setting(
        10.0, "fail a handoff whose engine has had no live stream for this long, in seconds"
    )
    cleanup_timeout_s: float = _setting(
        300.0, "abandon a handoff still cleaning up after this long, in seconds"
    )
    cleanup_redelivery_s: float = _setting(
        1.0, "first redelivery delay of an unacknowledged cleanup action (doubles, max 30 s)"
    )
    retention_s: float = _setting(
        600.0, "keep completed handoffs this long for late reports and id reuse checks"
    )
    max_retained: int = _setting(100_000, "completed handoffs kept at most (oldest evicted)")
    max_active_handoffs: int = _setting(
        100_000, "handoffs not yet complete at most; past it StartHandoff is refused"
    )
    max_queued_actions_per_engine: int = _setting(
        10_000, "undelivered actions per engine at most; past it StartHandoff is refused"
    )
    drain_grace_s: float = _setting(
        20.0, "on SIGTERM, wait this long for active handoffs before canceling them"
    )
    log_format: str = _setting("text", "log format", choices=("text", "json"))
    log_level: str = _setting("info", "log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{setting.name} must be finite and >= 0, got {value}")
            choices = setting.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{setting.name} must be one of {', '.join(choices)}")
        for name in ("max_retained", "max_active_handoffs", "max_queued_actions_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def _parser(default: object) -> Any:
    return type(default)


def env_name(name: str) -> str:
    return "HANDOFF_" + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; --help shows the default and the variable."""
    for setting in fields(Settings):
        parser.add_argument(
            "--" + setting.name.replace("_", "-"),
            dest=setting.name,
            type=_parser(setting.default),
            choices=setting.metadata.get("choices"),
            default=None,
            help=f"{setting.metadata['help']} (default: {setting.default}; "
            f"env {env_name(setting.name)})",
        )


def from_arguments(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    values: dict[str, Any] = {}
    for setting in fields(Settings):
        value = getattr(args, setting.name, None)
        if value is None and env_name(setting.name) in environ:
            raw = environ[env_name(setting.name)]
            parse = _parser(setting.default)
            try:
                value = parse(raw)
            except ValueError as error:
                raise ValueError(f"{env_name(setting.name)}={raw!r}: {error}") from error
        if value is not None:
            values[setting.name] = value
    return dataclasses.replace(Settings(), **values)
