"""deploy/prometheus: promtool checks the rules and runs their tests, which cover every alert."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.deploy import (
    OPERATIONS,
    RULES,
    RULES_TEST,
    alert_rules,
    dashboard,
    dashboard_queries,
    grafana_to_promql,
    load_yaml,
    missing,
)


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        missing("promtool not found (Debian: apt-get install prometheus)")
    assert found is not None
    return found


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_check_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("rules_edit", "test_edit"),
    [
        # an alert whose threshold no longer matches its synthetic series
        (("          > 0.25\n", "          > 0.5\n"), None),
        # an expectation that is wrong
        (None, ("(threshold 5%); see", "(threshold 6%); see")),
        # an alert that fires on the healthy series
        (("job) (handoff_engine_streams) == 0", "job) (handoff_engine_streams) >= 0"), None),
        # a per-shard alert that no longer names the shard
        (
            (
                'max by (namespace, job, shard) (up{job="handoff"}) == 0\n',
                'max by (namespace, job) (up{job="handoff"}) == 0\n',
            ),
            None,
        ),
        # placement skew that counts a draining shard (it starts none) in the average
        (("(rate(handoff_started_total[15m])) > 0)", "(rate(handoff_started_total[15m])))"), None),
    ],
)
def test_promtool_unit_tests_catch_a_broken_rule(
    promtool: str,
    tmp_path: Path,
    rules_edit: tuple[str, str] | None,
    test_edit: tuple[str, str] | None,
) -> None:
    for source, edit in ((RULES, rules_edit), (RULES_TEST, test_edit)):
        text = source.read_text()
        if edit is not None:
            assert text.count(edit[0]) == 1, edit[0]
            text = text.replace(*edit)
        (tmp_path / source.name).write_text(text)
    result = run(promtool, "test", "rules", str(tmp_path / RULES_TEST.name))
    assert result.returncode != 0, result.stdout
    assert "FAILED" in result.stdout + result.stderr


def unit_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = load_yaml(RULES_TEST)["tests"]
    return tests


def test_every_alert_fires_on_a_synthetic_series_and_stays_quiet_when_healthy() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)), "alert names must be unique"
    healthy = unit_tests()[0]  # the first test is the healthy hour; see the file's header
    quiet = {t["alertname"] for t in healthy["alert_rule_test"] if t["exp_alerts"] == []}
    fires = {
        t["alertname"]
        for test in unit_tests()[1:]
        for t in test.get("alert_rule_test", [])
        if t["exp_alerts"]
    }
    for name in names:
        assert name in quiet, f"{name}: no 'stays quiet on healthy traffic' expectation"
        assert name in fires, f"{name}: no 'fires on a synthetic series' expectation"
    assert quiet | fires <= set(names), "the unit tests name an alert rules.yaml does not have"


def test_every_alert_has_a_severity_an_explanation_and_a_runbook_entry() -> None:
    runbooks = OPERATIONS.read_text().partition("## Alerts")[2]
    assert runbooks, "docs/operations.md has no '## Alerts' section"
    for rule in alert_rules():
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]
        alert = rule["alert"]
        assert f"**`{alert}`**" in runbooks, f"docs/operations.md: no runbook for {alert}"


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """promtool parses each dashboard query (Grafana variables filled in) as a rule."""
    queries = dashboard_queries(dashboard())
    rules = [
        {"record": f"dashboard:query{index}", "expr": grafana_to_promql(query)}
        for index, query in enumerate(queries)
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
