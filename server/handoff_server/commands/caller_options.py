"""The TLS and token options of the commands that call a server (inspect, health).

One set of flags, read one way, so `handoff health` reaches whatever
`handoff inspect` reaches. Needs only the SDK: both commands run where only
`kv-handoff` is installed. Also the hints for the mistakes these options
invite: the server's token file given as the client's, and plaintext against
TLS or the other way round, which gRPC reports only as a closed socket or a
handshake failure.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypedDict

from handoff_client.credentials import ChannelSecurity


class ClientOptions(TypedDict):
    """HandoffClient's keyword arguments for TLS and the bearer token."""

    tls: bool | None
    tls_root_cert: str | None
    tls_client_cert: str | None
    tls_client_key: str | None
    token: str | None


def add_arguments(parser: argparse.ArgumentParser, scope: str) -> None:
    """The TLS and token flags; ``scope`` is what the token must allow."""
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
        help=f"file holding a bearer token{scope} alone (not on the command line, where "
        "other users of the machine could see it)",
    )


def security(args: argparse.Namespace) -> ChannelSecurity:
    """What the flags ask for. Raises OSError or ValueError, naming the flag."""
    return ChannelSecurity.from_options(
        tls=args.tls or None,
        tls_root_cert=args.tls_root_cert,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
        token=read_token(args.token_file),
    )


def client_options(args: argparse.Namespace) -> ClientOptions:
    """The flags as HandoffClient's keyword arguments (`handoff proxy` builds
    its client later, in its own event loop). Raises ValueError naming the flag."""
    return ClientOptions(
        tls=args.tls or None,
        tls_root_cert=args.tls_root_cert,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
        token=read_token(args.token_file),
    )


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ValueError(f"--token-file {path}: {error.strerror or error}") from error
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    if len(token.split()) > 1:
        raise ValueError(
            f"--token-file {path} holds more than a token: it looks like the server's "
            "token file (NAME TOKEN [SCOPE,...] per line); a client's holds its token alone"
        )
    return token


# What gRPC says when the two ends disagree on TLS.
PLAINTEXT_TO_TLS = ("socket closed", "connection reset", "end of tcp stream")
TLS_TO_PLAINTEXT = ("ssl", "handshake", "wrong_version_number", "tls")


def transport_hint(details: str, tls: bool) -> str:
    """A hint for an UNAVAILABLE that looks like a TLS mismatch; '' otherwise."""
    said = details.lower()
    if not tls and any(words in said for words in PLAINTEXT_TO_TLS):
        return (
            " (if the server speaks TLS, add --tls-root-cert CA.pem, or --tls for the "
            "system's roots)"
        )
    if tls and any(words in said for words in TLS_TO_PLAINTEXT):
        return (
            " (the TLS handshake failed: if the server is plaintext, drop --tls and "
            "--tls-root-cert; else check that --tls-root-cert signed its certificate)"
        )
    return ""
