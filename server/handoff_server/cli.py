"""The `handoff` command: one subcommand per job, each in its own module.

`pip install handoff` brings only the SDK's dependencies. The commands that
need the server's (serve, health, sim, demo) are still listed then, and say
how to get them instead of failing with an ImportError.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

# Each module has add_parser(commands), which registers one subcommand.
COMMANDS = {
    "serve": "handoff_server.serve",
    "inspect": "handoff_server.inspect_cmd",
    "replay": "handoff_server.replay",
    "health": "handoff_server.health",
    "sim": "handoff_client.sim.cli",
    "demo": "handoff_server.demo",
    # Imports aiohttp only when it runs (the [proxy] extra).
    "proxy": "handoff_proxy.config",
}
SERVER_EXTRA = "pip install 'handoff[server]'"


def installed_version() -> str:
    try:
        return version("handoff")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="handoff",
        description="Coordinate prefill-to-decode KV-cache handoffs for disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"handoff {installed_version()}")
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


def _add_unavailable(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, missing: str
) -> None:
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
