"""Safe defaults: loopback unless told otherwise, and a warning when told to open up."""

from __future__ import annotations

import logging

import pytest

from handoff_server.ops.config import Settings
from handoff_server.service.exposure import is_loopback, warn_if_open


def test_every_listener_binds_loopback_by_default() -> None:
    settings = Settings()
    assert (settings.host, settings.metrics_host, settings.health_host) == ("127.0.0.1",) * 3


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("handoff-0", False),
    ],
)
def test_which_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_open_plaintext_tokenless_port_warns_naming_the_flags(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        warn_if_open("0.0.0.0", tls=False, tokens=False)
    (line,) = warnings(caplog)
    for flag in ("--tls-cert", "--tls-key", "--token-file", "--host 127.0.0.1"):
        assert flag in line
    assert "Production checklist" in line


@pytest.mark.parametrize(
    ("host", "tls", "tokens"),
    [("127.0.0.1", False, False), ("0.0.0.0", True, False), ("0.0.0.0", False, True)],
)
def test_loopback_tls_or_tokens_say_nothing(
    caplog: pytest.LogCaptureFixture, host: str, tls: bool, tokens: bool
) -> None:
    with caplog.at_level(logging.WARNING):
        warn_if_open(host, tls=tls, tokens=tokens)
    assert warnings(caplog) == []
