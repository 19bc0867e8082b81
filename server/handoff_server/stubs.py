"""Generate the Python stubs in client/handoff/v1 from proto/.

`python -m handoff_server.stubs --write` regenerates the committed stubs;
`--check` exits 1 when they have drifted from the proto. Needs grpcio-tools
and mypy-protobuf (the test extras).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
STUB_ROOT = ROOT / "client"
PROTOS = ("handoff/v1/coordinator.proto",)
GENERATED = (
    "coordinator_pb2.py",
    "coordinator_pb2.pyi",
    "coordinator_pb2_grpc.py",
    "coordinator_pb2_grpc.pyi",
)


def generate(out: Path) -> None:
    """Run protoc (from grpcio-tools) over PROTOS into ``out``."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    plugins = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
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
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


def drifted() -> list[str]:
    """Names of committed stubs that differ from freshly generated ones."""
    with tempfile.TemporaryDirectory() as scratch:
        generate(Path(scratch))
        fresh = Path(scratch) / "handoff" / "v1"
        committed = STUB_ROOT / "handoff" / "v1"
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
    args = parser.parse_args()
    if args.write:
        generate(STUB_ROOT)
        return 0
    stale = drifted()
    for name in stale:
        print(f"drifted from proto/: client/handoff/v1/{name}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
