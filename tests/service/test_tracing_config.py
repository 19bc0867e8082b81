"""Turning tracing on: --otlp-endpoint, HANDOFF_OTLP_ENDPOINT, OTEL_* and the ConfigMap."""

from __future__ import annotations

import re
from pathlib import Path

from handoff_server.commands.cli import build_parser
from handoff_server.ops import config, tracing

SETTINGS_ENV = Path(__file__).parents[2] / "deploy" / "k8s" / "settings.env"


def parse(argv: list[str], environ: dict[str, str]) -> config.Settings:
    return config.from_arguments(build_parser().parse_args(["serve", *argv]), environ)


def test_tracing_is_off_by_default() -> None:
    assert parse([], {}).otlp_endpoint == ""
    assert tracing.from_settings("", {}) is tracing.OFF


def test_the_endpoint_is_a_flag_or_a_variable() -> None:
    endpoint = "http://collector:4317"
    assert parse(["--otlp-endpoint", endpoint], {}).otlp_endpoint == endpoint
    assert parse([], {"HANDOFF_OTLP_ENDPOINT": endpoint}).otlp_endpoint == endpoint


def test_the_standard_otel_variables_turn_it_on_too() -> None:
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        tracer = tracing.from_settings("", {variable: "http://collector:4317"})
        assert isinstance(tracer, tracing.Tracing)
        tracer.shutdown()


def test_the_configmaps_commented_endpoint_is_a_valid_setting() -> None:
    (endpoint,) = re.findall(r"^# HANDOFF_OTLP_ENDPOINT=(\S+)$", SETTINGS_ENV.read_text(), re.M)
    assert parse([], {"HANDOFF_OTLP_ENDPOINT": endpoint}).otlp_endpoint == endpoint
