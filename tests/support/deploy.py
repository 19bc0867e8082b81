"""Helpers for the deploy/ tests (external validators, PromQL name extraction).

Their own tests are in tests/deploy/test_deploy_support.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "rules.yaml"
RULES_TEST = DEPLOY / "prometheus" / "rules_test.yaml"
DASHBOARD = DEPLOY / "grafana" / "handoff.json"
DOCKERFILE = ROOT / "Dockerfile"
OPERATIONS = ROOT / "docs" / "operations.md"


def missing(reason: str) -> None:
    """A validator is not installed: skip locally, fail in CI (CI=true) where it must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: this validator must run in CI)")
    pytest.skip(reason)


def tool(name: str, how: str) -> str:
    """The path of an executable: next to this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        missing(f"{name} not found ({how})")
        raise AssertionError("unreachable")  # missing() always raises
    return found


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = load_yaml(RULES)["groups"]
    return groups


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def recorded_names() -> set[str]:
    return {
        rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule
    }


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def panels(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    found: list[dict[str, Any]] = []
    for panel in document.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def dashboard_queries(document: dict[str, Any]) -> list[str]:
    """PromQL of every panel target and every query variable (label_values' selector)."""
    queries = [target["expr"] for panel in panels(document) for target in panel.get("targets", [])]
    for variable in document.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text.strip())
        assert match, f"variable {variable['name']}: only label_values(SELECTOR, LABEL) is checked"
        queries.append(match.group(1))
    return queries


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables so promtool can parse the expression."""
    expr = re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


# ---- PromQL: which metric names and label matchers an expression uses ----

KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
NAME = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()")
LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
SELECTOR = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def metric_names(expr: str) -> set[str]:
    """Metric names (including recording rules) an expression reads."""
    stripped = re.sub(r"\{[^}]*\}", " ", expr)  # matchers first: their values are strings
    stripped = STRING.sub(" ", stripped)
    stripped = re.sub(r"\[[^\]]*\]", " ", stripped)  # range and subquery durations
    stripped = LABEL_LIST.sub(" ", stripped)  # `sum by (le) (...)` reads as `sum (...)`
    stripped = re.sub(r"\$\{?\w+\}?", " ", stripped)  # Grafana variables
    return {name for name in NAME.findall(stripped) if name.lower() not in KEYWORDS}


@dataclass(frozen=True)
class Matcher:
    metric: str
    label: str
    op: str
    value: str


def matchers(expr: str) -> set[Matcher]:
    """Label matchers attached to a metric name, e.g. handoff_handoffs{phase="active"}."""
    return {
        Matcher(metric, label, op, value)
        for metric, body in SELECTOR.findall(expr)
        for label, op, value in MATCHER.findall(body)
    }
