"""The connector's settings, from ``kv_connector_extra_config["handoff"]``.

Parsed without vLLM so the checks (and their messages) are the same wherever
they run. Every error names the key that fixes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NIXL's own default lease on a prefill's held blocks (vLLM 0.32).
NIXL_DEFAULT_LEASE_S = 30
KNOWN_KEYS = frozenset(
    {
        "coordinator",
        "engine_id",
        "deadline_s",
        "delivery_timeout_s",
        "bandwidth_gb_s",
        "tls",
        "tls_root_cert",
        "tls_client_cert",
        "tls_client_key",
        "token",
        "token_file",
        "timeout_s",
        "subscribe_timeout_s",
        "allow_other_vllm",
        "nixl_progress_delay_us",
    }
)


class SettingsError(ValueError):
    """A setting the connector cannot start with; the message names the key."""


@dataclass(frozen=True)
class Settings:
    coordinator: str
    engine_id: str
    # The handoff deadline the frontend uses and the coordinator's delivery
    # timeout: NIXL's lease must outlast both (see kv_lease_s).
    deadline_s: float = 300.0
    delivery_timeout_s: float = 10.0
    # The link's rate for SourceHeld's TransferTiming; None: the handoff's
    # fallback_transfer_delay_ms is used.
    bandwidth_gb_s: float | None = None
    tls: bool = False
    tls_root_cert: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    token: str | None = None
    timeout_s: float = 10.0
    # How long the engine's start waits for its sidecar to subscribe: an engine
    # that serves before it is a live engine for the coordinator has each
    # handoff naming it canceled at once (EngineLost, unreachable).
    subscribe_timeout_s: float = 30.0
    allow_other_vllm: bool = False
    # The longest NIXL's progress thread sleeps without an event (pacing.py);
    # 0 leaves nixl's own 0, a thread that spins a core.
    nixl_progress_delay_us: int = 1000

    @property
    def kv_lease_s(self) -> int:
        """The NIXL lease a held source falls back to when the coordinator is gone."""
        return int(self.deadline_s + self.delivery_timeout_s + 0.999)

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for HandoffClient: TLS and the token, as for any SDK client."""
        options: dict[str, Any] = {"timeout_s": self.timeout_s}
        if self.tls:
            options["tls"] = True
        for key in ("tls_root_cert", "tls_client_cert", "tls_client_key", "token"):
            value = getattr(self, key)
            if value is not None:
                options[key] = value
        return options


def parse(extra: Mapping[str, Any], kv_lease_duration: object) -> Settings:
    """Settings from the kv_connector_extra_config; ``kv_lease_duration`` is NIXL's key."""
    raw = extra.get("handoff")
    where = 'kv_connector_extra_config["handoff"]'
    if not isinstance(raw, Mapping):
        raise SettingsError(
            f"HandoffConnector needs {where}: an object with at least "
            '"coordinator" (HOST:PORT) and "engine_id"'
        )
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise SettingsError(f"{where} has unknown keys {unknown}; known: {sorted(KNOWN_KEYS)}")
    for key in ("coordinator", "engine_id"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise SettingsError(f'{where}["{key}"] must be a non-empty string')
    values = dict(raw)
    token_file = values.pop("token_file", None)
    if token_file is not None:
        if "token" in values:
            raise SettingsError(f'{where}: give "token" or "token_file", not both')
        try:
            values["token"] = Path(token_file).read_text().strip()
        except OSError as error:
            raise SettingsError(
                f'{where}["token_file"]: cannot read {token_file}: {error}'
            ) from None
    for key in ("deadline_s", "delivery_timeout_s", "timeout_s", "subscribe_timeout_s"):
        if key in values and not (isinstance(values[key], int | float) and values[key] > 0):
            raise SettingsError(f'{where}["{key}"] must be a positive number of seconds')
    delay = values.get("nixl_progress_delay_us", 0)
    if not (isinstance(delay, int) and not isinstance(delay, bool) and 0 <= delay <= 1_000_000):
        raise SettingsError(
            f'{where}["nixl_progress_delay_us"] must be a whole number of microseconds '
            "from 0 (NIXL's own: its progress thread spins) to 1000000"
        )
    settings = Settings(**values)
    if kv_lease_duration is not None and (
        not isinstance(kv_lease_duration, int | float) or kv_lease_duration < settings.kv_lease_s
    ):
        raise SettingsError(
            f'kv_connector_extra_config["kv_lease_duration"] is {kv_lease_duration!r}: '
            f"NIXL's lease on a held prefill must be at least the handoff deadline plus "
            f"the delivery timeout ({settings.deadline_s:g} + "
            f"{settings.delivery_timeout_s:g} s), or a held source whose coordinator is gone "
            f"could be freed while a decode still reads it; set it to at least "
            f"{settings.kv_lease_s}, or leave it out and the connector sets it"
        )
    return settings
