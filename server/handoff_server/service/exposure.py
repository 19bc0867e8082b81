"""Whether the gRPC port is open to the network unprotected, said at start.

`handoff serve` binds loopback unless told otherwise; an operator who binds
another address without TLS or tokens lets anyone who can reach it start,
cancel and report on handoffs. That is allowed (a trusted network, a mesh
doing TLS), but said once as a WARNING naming the flags that secure it.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger("handoff.server")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as a server binds it) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def warn_if_open(host: str, *, tls: bool, tokens: bool) -> None:
    if is_loopback(host) or tls or tokens:
        return
    log.warning(
        "the gRPC port on %s is plaintext and takes no token: anyone who can reach it "
        "may start, cancel and report on handoffs. Secure it with --tls-cert/--tls-key "
        "(and --tls-client-ca) and --token-file, or bind loopback with --host 127.0.0.1 "
        '(docs/security.md, "Production checklist")',
        host,
    )
