"""The `handoff` command: one subcommand per job, each in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from handoff_client.sim import cli as sim_cli
from handoff_client.sim import demo
from handoff_server import health, inspect_cmd, replay, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="handoff",
        description="Coordinate prefill-to-decode KV-cache handoffs for disaggregated LLM serving.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    serve.add_parser(commands)
    inspect_cmd.add_parser(commands)
    replay.add_parser(commands)
    health.add_parser(commands)
    sim_cli.add_parser(commands)
    demo.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
