"""Generate the Python stubs in client/handoff_proto/v1 from proto/.

`python -m handoff_server.commands.stubs --write` regenerates the committed stubs;
`--check` exits 1 when they have drifted from the proto.

The generator is pinned, and old on purpose: protoc's Python code and gRPC's
*_pb2_grpc.py only run on a runtime at least as new as the generator (newer
generators check it at import), so the oldest grpcio-tools that installs on
our Pythons gives the SDK the widest grpcio/protobuf range (pyproject.toml).
It lives in a venv of its own (TOOL_VENV), made on first use, since its
protobuf cannot share one with the server's. The .pyi come from mypy-protobuf
in the calling venv (the test extra): they type enums and pass mypy --strict.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = ROOT / "proto"
STUB_ROOT = ROOT / "client"
# The .proto stays at proto/handoff/v1 (its package, handoff.v1, is the wire
# name); protoc sees it at handoff_proto/v1, so the Python modules land in a
# package of ours instead of a top-level `handoff` that PyPI's unrelated
# `handoff` project also ships.
PROTO_DIR = "handoff/v1"
STUB_DIR = "handoff_proto/v1"
PROTOS = (f"{STUB_DIR}/coordinator.proto",)
GENERATED = (
    "coordinator_pb2.py",
    "coordinator_pb2.pyi",
    "coordinator_pb2_grpc.py",
    "coordinator_pb2_grpc.pyi",
)
# Python 3.11 wheels start here; its protoc (3.21.6) writes protobuf 4.21.6 code.
GRPCIO_TOOLS = "1.49.1"
TOOL_VENV = ROOT / ".venv" / f"grpcio-tools-{GRPCIO_TOOLS}"


def toolchain() -> Path:
    """The Python of the pinned grpcio-tools venv, made if it is not there yet."""
    python = TOOL_VENV / "bin" / "python"
    installed = TOOL_VENV / "installed"  # written last: a half-made venv is made again
    if not installed.exists():
        venv.create(TOOL_VENV, clear=True, with_pip=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--only-binary=:all:", f"grpcio-tools=={GRPCIO_TOOLS}"], check=True)
        installed.touch()
    return python


def generate(out: Path) -> None:
    """Run the pinned protoc over PROTOS into ``out``."""
    plugins = Path(sys.executable).parent
    args = [
        str(toolchain()),
        "-m",
        "grpc_tools.protoc",  # adds grpc_tools' well-known protos to the path
        f"-I{STUB_DIR}={PROTO_ROOT / PROTO_DIR}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        # mypy-protobuf's stubs, unlike protoc's own --pyi_out, type enums
        # and are clean under mypy --strict.
        f"--plugin=protoc-gen-mypy={plugins / 'protoc-gen-mypy'}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={plugins / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={out}",
        *PROTOS,
    ]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed ({' '.join(args)}):\n{done.stderr}")


def drifted() -> list[str]:
    """Names of committed stubs that differ from freshly generated ones."""
    with tempfile.TemporaryDirectory() as scratch:
        generate(Path(scratch))
        fresh = Path(scratch) / STUB_DIR
        committed = STUB_ROOT / STUB_DIR
        return [
            name
            for name in GENERATED
            if not (committed / name).exists()
            or not filecmp.cmp(fresh / name, committed / name, shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate the committed stubs")
    action.add_argument("--check", action="store_true", help="fail if the stubs have drifted")
    action.add_argument(
        "--toolchain", action="store_true", help="make the pinned grpcio-tools venv, if missing"
    )
    args = parser.parse_args()
    if args.toolchain:
        print(toolchain())
        return 0
    if args.write:
        generate(STUB_ROOT)
        return 0
    stale = drifted()
    for name in stale:
        print(f"drifted from proto/: client/{STUB_DIR}/{name}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
