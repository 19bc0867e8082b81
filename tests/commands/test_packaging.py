"""What `pip install kv-handoff` promises, kept in step with what CI proves."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from handoff_server.commands import stubs

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
MAKEFILE = (ROOT / "Makefile").read_text()


def floor(requirement: str) -> str:
    (found,) = re.findall(r">=([\d.]+)", requirement)
    return str(found)


def make_variable(name: str) -> str:
    (value,) = re.findall(rf"^{name} := (\S+)$", MAKEFILE, re.MULTILINE)
    return str(value)


def test_the_sdk_needs_only_grpcio_and_protobuf_in_ranges() -> None:
    names = [re.split(r"[<>=]", d)[0] for d in PROJECT["dependencies"]]
    assert names == ["grpcio", "protobuf"]
    assert all("<" in d and ">=" in d for d in PROJECT["dependencies"])
    server = " ".join(PROJECT["optional-dependencies"]["server"])
    for module in ("prometheus-client", "grpcio-health-checking", "grpcio-reflection", "uvloop"):
        assert module in server
    assert not any(
        "grpcio-tools" in d for extra in PROJECT["optional-dependencies"].values() for d in extra
    )


def test_make_test_sdk_runs_at_the_floors_the_generator_allows() -> None:
    grpcio, protobuf = PROJECT["dependencies"]
    assert make_variable("SDK_GRPCIO") == floor(grpcio) == stubs.GRPCIO_TOOLS
    assert make_variable("SDK_PROTOBUF") == floor(protobuf)


def test_classifiers_name_the_pythons_make_test_runs() -> None:
    classified = {
        c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"] if re.search(r"3\.\d+$", c)
    }
    assert classified == {"3.11", "3.12", "3.13"}
    assert "PYTHON312 :=" in MAKEFILE
    assert "PYTHON313 :=" in MAKEFILE
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX string: no setuptools warning


def test_the_sdk_imports_nothing_of_the_server() -> None:
    """An engine's image installs the SDK without the server's dependencies."""
    sdk = ROOT / "client" / "handoff_client"
    importing = [
        str(path.relative_to(ROOT))
        for path in sorted(sdk.rglob("*.py"))
        if re.search(r"^\s*(from|import) handoff_server\b", path.read_text(), re.MULTILINE)
    ]
    assert importing == []


def test_the_distribution_has_a_name_of_its_own() -> None:
    """`handoff` on PyPI is an unrelated project that ships a `handoff` module too."""
    from handoff_server.commands.cli import DISTRIBUTION

    assert PROJECT["name"] == DISTRIBUTION == "kv-handoff"
    tops = {p.name for p in (ROOT / "client").iterdir() if (p / "__init__.py").exists()}
    tops |= {p.name for p in (ROOT / "server").iterdir() if (p / "__init__.py").exists()}
    assert "handoff" not in tops
    assert (ROOT / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]


def test_the_version_is_the_same_everywhere() -> None:
    """pyproject's version heads the changelog and tags the image the manifests run."""
    version = PROJECT["version"]
    (top,) = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)[:1]
    assert top == version
    deploy = ROOT / "deploy" / "k8s"
    assert f"image: handoff:{version}" in (deploy / "statefulset.yaml").read_text()
    assert f"newTag: {version}" in (deploy / "kustomization.yaml").read_text()
    assert f"handoff:{version} ." in (ROOT / "Dockerfile").read_text()
