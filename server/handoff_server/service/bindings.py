"""Which engines a call's caller may act for, from the credentials it presents.

A token binds its holder by its line's ``engines=``; a client certificate by
the identity file (security.py loads both). The guard builds a
:class:`Caller` for every coordinator call and puts it in :data:`CALLER`;
the servicer checks it through :func:`authorize_engine` and
:func:`authorize_report`, inside the same synchronous step that changes the
handoff. The rules themselves are the domain's (domain/authorization.py);
what is here is who the caller is and where its refusal says to look.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from handoff_server.domain import authorization
from handoff_server.domain.authorization import UNBOUND, Binding
from handoff_server.domain.entries import Entry
from handoff_server.domain.model import Fact
from handoff_server.domain.retained import Retained
from handoff_server.service.security import SAN_PROPERTIES, EngineIdentities, Token, TokenSet


@dataclass(frozen=True, slots=True)
class Credential:
    """One credential a caller presents (a token, a client certificate): its
    name in refusals, the engines it lets the caller act for, and where to
    change them (``fix``, with ``{engine}`` for the engine refused)."""

    name: str
    engines: Binding
    fix: str


@dataclass(frozen=True, slots=True)
class Caller:
    """The peer of one call, as far as engines go: what each of its
    credentials lets it act for. It acts for an engine only where every one
    of them does (a token and a certificate must both name it)."""

    credentials: tuple[Credential, ...]

    @property
    def engines(self) -> Binding:
        engines = self.credentials[0].engines
        for credential in self.credentials[1:]:
            engines &= credential.engines
        return engines

    def fix(self, engine_id: str) -> str:
        """Where to give this caller ``engine_id``: the first credential that does not."""
        lacking = [c for c in self.credentials if not c.engines.covers(engine_id)]
        return (lacking or list(self.credentials))[0].fix.format(engine=engine_id)

    def __str__(self) -> str:
        return " with ".join(credential.name for credential in self.credentials)


def certificate(
    identities: EngineIdentities | None, auth_context: Mapping[str, Iterable[bytes]]
) -> Credential:
    """A verified client certificate, with the engines ``identities`` maps its
    SANs to; without an identity file it names none (a frontend's)."""
    sans = tuple(
        (kind, value.decode("utf-8", "replace"))
        for kind, name in SAN_PROPERTIES.items()
        for value in auth_context.get(name, ())
    )
    shown = ", ".join(f"{kind}:{value[:80]}" for kind, value in sans[:4]) or "no SAN"
    if identities is None:
        engines = UNBOUND
        fix = (
            "a certificate acts for the engines engine_identity_file maps its SANs to, "
            "and none is set: map one of its SANs to {engine} there"
        )
    else:
        engines = Binding.of(identities.engines_for(sans))
        fix = "map one of its SANs to {engine} in " + identities.source.replace("{", "{{")
    return Credential(f"client certificate ({shown})", engines, fix)


def caller_of(
    holder: Token | None,
    *,
    tokens: bool,
    identities: EngineIdentities | None,
    mutual: bool,
    auth_context: Callable[[], Mapping[str, Iterable[bytes]]],
) -> Caller | None:
    """The credentials that bind the caller of one call to engines; None when
    nothing identifies callers (no token, no client certificate): then any
    caller acts for any engine.

    A token binds by its ``engines=`` (none written: no engine). A client
    certificate binds by the identity file, when one is set, and also
    without one when it is the only credential (mutual TLS, no tokens): then
    it names no engine. So every identified caller acts only for the engines
    written for it, and never for one by default.
    """
    credentials = []
    if holder is not None:
        credentials.append(token_credential(holder))
    elif tokens:
        credentials.append(ANONYMOUS)
    if identities is not None or (mutual and not tokens):
        credentials.append(certificate(identities, auth_context()))
    return Caller(tuple(credentials)) if credentials else None


# A call without a token where tokens are on (a method of --auth-exempt-methods).
ANONYMOUS = Credential(
    "a caller without a token",
    UNBOUND,
    "{engine} is acted for only with a token naming it: remove the method from auth_exempt_methods",
)


def token_credential(token: Token) -> Credential:
    """A token's engines (its line's ``engines=``), and where to change them."""
    if token.source == "tokens":
        fix = (
            "tokens from tokens (HANDOFF_TOKENS) act for no engine; give this caller a "
            "line NAME TOKEN [SCOPES] engines={engine} in token_file"
        )
    else:
        fix = "add {engine} to engines= on its line of " + token.source.replace("{", "{{")
    return Credential(str(token), token.engines, fix)


def binding_warnings(
    tokens: TokenSet | None, identities: EngineIdentities | None, *, mutual: bool
) -> list[str]:
    """What to say at start about engine bindings that refuse every engine, or
    allow them all: an upgrade from a version that bound none must not fail
    its sidecars silently, nor keep an any-engine token unnoticed."""
    warnings = []
    for token in tokens.holders if tokens is not None else ():
        if "engine" in token.scopes and not token.engines.engine:
            warnings.append(
                f"{token} may call StreamActions, Connect and Reconcile (scope engine) but "
                f"names no engine, so each is refused: add engines=ID,... to its line of "
                f'{token.source} (docs/security.md, "Engine bindings")'
            )
        elif token.engines.any_engine:
            warnings.append(
                f"{token} acts for every engine (engines=*): whoever holds it can subscribe, "
                f"reconcile and report as any engine; list its engines in {token.source}"
            )
    if mutual and tokens is None and identities is None:
        warnings.append(
            "mutual TLS without tokens and without engine_identity_file: a certificate acts "
            "for no engine, so every StreamActions, Connect and Reconcile is refused; map "
            'the engines\' SANs in engine_identity_file (docs/security.md, "Engine bindings")'
        )
    return warnings


# Set by the guard for every coordinator call whose caller is identified
# (tokens, mutual TLS); None: nothing identifies callers, so none is bound.
# Each call runs in its own task, and the Connect report reader inherits its
# stream's value.
CALLER: ContextVar[Caller | None] = ContextVar("handoff_caller", default=None)


def authorize_engine(engine_id: str) -> str:
    """For StreamActions, Connect and Reconcile: the caller may act as ``engine_id``."""
    caller = CALLER.get()
    if caller is not None:
        authorization.check_engine(str(caller), caller.engines, engine_id, caller.fix)
    return engine_id


def authorize_report(
    entry: Entry | Retained, *, fact: Fact | None = None, action_id: int | None = None
) -> None:
    """For ReportFact and ReportOutcome (also on Connect), before the registry
    call: the rule is the domain's (domain/authorization.py), the caller's
    engines are its credentials'."""
    caller = CALLER.get()
    if caller is not None:
        authorization.check(
            str(caller), caller.engines, entry, caller.fix, fact=fact, action_id=action_id
        )
