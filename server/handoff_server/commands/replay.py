"""`handoff replay`: check conformance vector files against the core."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from handoff_server.commands.conformance import load_vectors, run_on_core


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "replay",
        help="replay conformance vectors through the state machine",
        description=(
            "Replay every vector in each FILE (JSON lines, the format of "
            "tests/conformance/README.md) through the coordinator core. Prints the "
            "first mismatching step of each failing vector and a closing "
            "'N passed, M failed' line; exits 0 only when nothing failed."
        ),
    )
    parser.add_argument("files", metavar="FILE", nargs="+", type=Path)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    passed = failed = 0
    for path in args.files:
        try:
            for vector in load_vectors(path):
                failure = run_on_core(vector)
                if failure is None:
                    passed += 1
                else:
                    failed += 1
                    print(f"FAIL {failure}")
        except (OSError, ValueError) as error:
            print(f"handoff replay: {error}", file=sys.stderr)
            return 2
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1
