"""The flags a command that calls the coordinator uses for TLS and its token.

One definition, so `handoff inspect` and `handoff proxy` spell and explain
them alike (docs/security.md), and both hand HandoffClient the same options.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypedDict


class SecurityOptions(TypedDict):
    """HandoffClient's keyword arguments for TLS and the bearer token."""

    tls: bool | None
    tls_root_cert: str | None
    tls_client_cert: str | None
    tls_client_key: str | None
    token: str | None


def add_arguments(parser: argparse.ArgumentParser, *, scopes: str) -> None:
    """The group of TLS and token flags; ``scopes`` names what the token must allow."""
    secure = parser.add_argument_group(
        "TLS and tokens", "for a server with HANDOFF_TLS_* or HANDOFF_TOKENS set (docs/security.md)"
    )
    secure.add_argument(
        "--tls-root-cert", metavar="PEM", help="CA to verify the server with; turns TLS on"
    )
    secure.add_argument(
        "--tls-client-cert", metavar="PEM", help="client certificate, for mutual TLS"
    )
    secure.add_argument("--tls-client-key", metavar="PEM", help="its private key")
    secure.add_argument(
        "--tls", action="store_true", help="TLS with the system's roots (no --tls-root-cert)"
    )
    secure.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file holding a bearer token with the {scopes} (not on the command "
        "line, where other users of the machine could see it)",
    )


def security_options(args: argparse.Namespace) -> SecurityOptions:
    """What the flags ask for; OSError or ValueError for an unreadable or empty token file."""
    return SecurityOptions(
        tls=args.tls or None,
        tls_root_cert=args.tls_root_cert,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
        token=read_token(args.token_file),
    )


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token
