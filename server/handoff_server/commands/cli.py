"""The `handoff` command: one subcommand per job, each in its own module.

`pip install kv-handoff` brings only the SDK's dependencies. The commands that
need the server's (serve, health, sim, demo) are still listed then, and say
how to get them instead of failing with an ImportError.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

# Each module has add_parser(commands), which registers one subcommand.
COMMANDS = {
    "serve": "handoff_server.commands.serve",
    "inspect": "handoff_server.commands.inspect_cmd",
    "replay": "handoff_server.commands.replay",
    "health": "handoff_server.commands.health",
    "sim": "handoff_client.sim.cli",
    "demo": "handoff_server.commands.demo",
    # Imports aiohttp only when it runs (the [proxy] extra).
    "proxy": "handoff_proxy.config",
}
# Our PyPI name: `handoff` there is an unrelated project.
DISTRIBUTION = "kv-handoff"
SERVER_EXTRA = f"pip install '{DISTRIBUTION}[server]'"


def installed_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class Parser(argparse.ArgumentParser):
    """Usage errors in one line naming the flag and what it takes, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {_expected(message)} (see {self.prog} --help)\n")


# argparse's "invalid int value: 'abc'", said as what the flag takes.
EXPECTED = {"int": "a whole number", "float": "a number", "parse_bool": "true or false"}


def _expected(message: str) -> str:
    invalid = re.fullmatch(r"(argument \S+): invalid (\w+) value: (.*)", message)
    if invalid is None or invalid.group(2) not in EXPECTED:
        return message
    flag, kind, value = invalid.groups()
    return f"{flag} takes {EXPECTED[kind]}, got {value}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="handoff",
        description="Coordinate prefill-to-decode KV-cache handoffs for disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"handoff {installed_version()}")
    # Each command's parser is a Parser too: argparse makes them of the parent's class.
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is None or error.name.partition(".")[0].startswith("handoff"):
                raise  # our own code is missing: a broken install, not a missing extra
            _add_unavailable(commands, name, error.name)
        else:
            module.add_parser(commands)
            # Its own usage, not the top level's, for an argument it does not know.
            commands.choices[name].set_defaults(command_parser=commands.choices[name])
    return parser


def _add_unavailable(commands: argparse._SubParsersAction[Parser], name: str, missing: str) -> None:
    """A command whose dependencies are not installed: it explains, whatever its arguments."""
    parser = commands.add_parser(
        name, help=f"(needs the server extra: {SERVER_EXTRA})", add_help=False
    )

    def run(args: argparse.Namespace) -> int:
        print(
            f"handoff {name}: needs the server's dependencies (module {missing!r} is not "
            f"installed); install them with: {SERVER_EXTRA}",
            file=sys.stderr,
        )
        return 2

    parser.set_defaults(run=run, command_parser=None)


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown and args.command_parser is not None:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
