"""The deploy/ tests' helpers: PromQL name extraction and the validator policy."""

from __future__ import annotations

import pytest

from tests.support.deploy import Matcher, grafana_to_promql, matchers, metric_names, tool


def test_metric_names_skip_functions_labels_strings_and_durations() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, kind) "
        '(rate(handoff_action_latency_seconds_bucket{job=~"$job", kind!="complete"}'
        "[$__rate_interval]))) / on (job) group_left sum(handoff:started:rate5m offset 5m) "
        'and ignoring (x) up{job="handoff"} == bool 0 or absent(foo_total) unless '
        'label_replace(bar, "dst", "$1", "src", "(.*)") > 1e9'
    )
    assert metric_names(expr) == {
        "handoff_action_latency_seconds_bucket",
        "handoff:started:rate5m",
        "up",
        "foo_total",
        "bar",
    }
    assert metric_names("sum(x_total) by (result, le) > inf") == {"x_total"}


def test_matchers_are_attached_to_their_metric() -> None:
    expr = 'sum(a_total{kind="failed", origin=~"engine|server"}) / b{phase!="x"}'
    assert matchers(expr) == {
        Matcher("a_total", "kind", "=", "failed"),
        Matcher("a_total", "origin", "=~", "engine|server"),
        Matcher("b", "phase", "!=", "x"),
    }


def test_grafana_variables_become_parseable() -> None:
    assert (
        grafana_to_promql('rate(x{job=~"$job", ns=~"${namespace}"}[$__rate_interval])')
        == 'rate(x{job=~".*", ns=~".*"}[5m])'
    )


def test_a_missing_validator_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-tool not found"):
        tool("no-such-tool", "install it")


def test_a_missing_validator_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: this validator must run in CI"):
        tool("no-such-tool", "install it")
