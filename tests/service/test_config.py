"""Settings: flags win over HANDOFF_* variables, which win over defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from handoff_server.commands.cli import build_parser
from handoff_server.ops import config


def parse(argv: list[str], environ: dict[str, str]) -> config.Settings:
    args = build_parser().parse_args(["serve", *argv])
    return config.from_arguments(args, environ)


def test_defaults_match_the_design() -> None:
    settings = parse([], {})
    assert settings == config.Settings()
    assert (settings.default_timeout_s, settings.delivery_timeout_s) == (300.0, 10.0)
    assert (settings.cleanup_timeout_s, settings.retention_s) == (300.0, 600.0)


def test_flag_beats_environment_beats_default() -> None:
    environ = {"HANDOFF_PORT": "6000", "HANDOFF_RETENTION_S": "60", "HANDOFF_LOG_FORMAT": "json"}
    settings = parse(["--port", "7000"], environ)
    assert settings.port == 7000
    assert settings.retention_s == 60.0
    assert settings.log_format == "json"


def test_every_setting_has_a_flag_and_a_variable_in_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for setting in dataclasses.fields(config.Settings):
        assert "--" + setting.name.replace("_", "-") in help_text
        assert config.env_name(setting.name) in help_text


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"HANDOFF_PORT": "eighty"}, "HANDOFF_PORT='eighty'"),
        ({"HANDOFF_RETENTION_S": "-5"}, "retention_s must be finite and >= 0"),
        ({"HANDOFF_LOG_FORMAT": "xml"}, "log_format must be one of text, json"),
        ({"HANDOFF_MAX_ACTIVE_HANDOFFS": "0"}, "max_active_handoffs must be >= 1"),
        (
            {"HANDOFF_JOURNAL_RESERVE_MIB": "4"},
            "journal_reserve_mib must be 0 \\(never refuse\\) or at least 32, got 4",
        ),
        ({"HANDOFF_JOURNAL_RESERVE_MIB": "-1"}, "journal_reserve_mib must be 0"),
        ({"HANDOFF_JOURNAL_BUSY_TIMEOUT_S": "0"}, "journal_busy_timeout_s must be > 0"),
    ],
)
def test_bad_values_are_refused_clearly(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config.from_arguments(argparse.Namespace(), environ)


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, False),
        (["--require-known-engines"], {}, True),
        (["--require-known-engines=false"], {"HANDOFF_REQUIRE_KNOWN_ENGINES": "1"}, False),
        ([], {"HANDOFF_REQUIRE_KNOWN_ENGINES": "true"}, True),
        ([], {"HANDOFF_REQUIRE_KNOWN_ENGINES": "off"}, False),
    ],
)
def test_a_switch_is_on_alone_and_reads_true_or_false(
    argv: list[str], environ: dict[str, str], expected: bool
) -> None:
    assert parse(argv, environ).require_known_engines is expected


def test_a_switch_refuses_a_value_that_is_not_true_or_false() -> None:
    with pytest.raises(ValueError, match="HANDOFF_REQUIRE_KNOWN_ENGINES='maybe'"):
        parse([], {"HANDOFF_REQUIRE_KNOWN_ENGINES": "maybe"})
