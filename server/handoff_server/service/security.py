"""Who may call the coordinator: TLS material, bearer tokens, engine identities.

Loaded once when the server starts, from the settings' files and variables;
a problem with any of them stops the start with a message naming the file.
The checks themselves run in :mod:`handoff_server.service.guard` (tokens, before any
handler) and, for the engines a caller may act for (a token's ``engines=``,
the identity file's), through :mod:`handoff_server.service.bindings`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from handoff_server.domain.authorization import UNBOUND, WILDCARD, Binding
from handoff_server.ops.config import Settings
from handoff_server.service.convert import ENGINE_ID

# RFC 6750 b64token: what an `Authorization: Bearer` header can carry.
TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
# Short tokens can be guessed; 16 characters of b64token are ~96 bits at best.
MIN_TOKEN_LENGTH = 16
BEARER = re.compile(r"bearer +(\S+)", re.IGNORECASE)
# The verified client certificate's SANs, by type, in gRPC's auth context.
# Only these two types name an engine: an email or IP SAN never does, and a
# URI SAN spelled like a host name is still a URI, not that host.
SAN_PROPERTIES = {"DNS": "peer_dns", "URI": "peer_uri"}


class SecurityConfigError(OSError):
    """Unusable security material. An OSError, like an unreadable file, so that
    ``handoff serve`` reports it as "cannot start" and exits 1."""


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise SecurityConfigError(f"{setting} {path}: {error.strerror or error}") from None


# --- TLS ----------------------------------------------------------------------


def _no_passphrase() -> str:
    raise SecurityConfigError("tls_key is encrypted; give an unencrypted key")


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS (mutual when a client CA is set) for the gRPC port; None for plaintext."""
    if not settings.tls_cert:
        return None
    chain = _read(settings.tls_cert, "tls_cert")
    key = _read(settings.tls_key, "tls_key")
    # gRPC would accept garbage here and fail every handshake later, silently;
    # the ssl module checks now that the files parse and the key fits the chain.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key, password=_no_passphrase)
    except ssl.SSLError as error:
        raise SecurityConfigError(
            f"tls_cert {settings.tls_cert} / tls_key {settings.tls_key}: {error.reason or error}"
        ) from None
    client_ca: bytes | None = None
    if settings.tls_client_ca:
        client_ca = _read(settings.tls_client_ca, "tls_client_ca")
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as error:
            raise SecurityConfigError(
                f"tls_client_ca {settings.tls_client_ca}: not a PEM CA bundle ({error})"
            ) from None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


# --- bearer tokens ------------------------------------------------------------


# What a token may call, by scope; a token without scopes in the file may call everything.
SCOPES: Mapping[str, frozenset[str]] = {
    "start": frozenset({"StartHandoff"}),
    "report": frozenset({"ReportFact", "ReportOutcome"}),
    "engine": frozenset({"StreamActions", "Connect", "Reconcile"}),
    "read": frozenset({"GetHandoff"}),
}
ALL_SCOPES = frozenset(SCOPES)
# Any token may ask where the shards are: a routing client of every kind needs it.
ANY_SCOPE = frozenset({"GetShardMap"})
TOKEN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True, slots=True)
class Token:
    """Who presents an accepted token: its name (the caller's identity), its
    scopes, the engines it may act for, and where it was given (for the
    refusals' "what to change"): ``token_file PATH``, or ``tokens``."""

    name: str
    scopes: frozenset[str] = ALL_SCOPES
    engines: Binding = UNBOUND
    source: str = "tokens"

    def may_call(self, rpc: str) -> bool:
        """``rpc`` is a coordinator method name; other services' calls need ``read``."""
        if rpc in ANY_SCOPE:
            return True
        needed = next((scope for scope, rpcs in SCOPES.items() if rpc in rpcs), "read")
        return needed in self.scopes

    def refusal(self, rpc: str) -> str | None:
        """Why this token may not call ``rpc``; None if it may."""
        if self.may_call(rpc):
            return None
        scopes = ", ".join(sorted(self.scopes)) or "none"
        return f"{self} may not call {rpc[:80]} (its scopes: {scopes})"

    def __str__(self) -> str:
        return f"token {self.name}"


class TokenSet:
    """The accepted tokens, compared in constant time.

    Only SHA-256 digests are kept. A presented token is hashed and compared
    with every digest, without stopping at a match, so the time taken says
    nothing about which token, or which prefix of one, was close.
    """

    def __init__(self, tokens: Iterable[str | tuple[str, Token]]) -> None:
        named = [
            (t, Token(f"token-{n}")) if isinstance(t, str) else t for n, t in enumerate(tokens, 1)
        ]
        self._digests = tuple((hashlib.sha256(t.encode()).digest(), who) for t, who in named)
        if not self._digests:
            raise SecurityConfigError("token authentication is on but no token is configured")
        names = [who.name for _, who in self._digests]
        repeated = {name for name in names if names.count(name) > 1}
        if repeated:
            raise SecurityConfigError(f"token names must differ: {', '.join(sorted(repeated))}")

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def holders(self) -> tuple[Token, ...]:
        return tuple(who for _, who in self._digests)

    def identify(self, presented: str) -> Token | None:
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for accepted, who in self._digests:
            if hmac.compare_digest(accepted, digest):
                found = who
        return found


def _checked_token(token: str, where: str) -> str:
    if not TOKEN.fullmatch(token):
        raise SecurityConfigError(
            f"{where} has characters a bearer token cannot carry "
            "(allowed: A-Z a-z 0-9 - . _ ~ + / and trailing =)"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise SecurityConfigError(f"{where} is shorter than {MIN_TOKEN_LENGTH} characters")
    return token


ENGINES_FIELD = "engines="


def _engines(field: str, where: str) -> Binding:
    """``engines=ID,prefix*,...`` of a token's line; ``engines=*``: every engine."""
    entries = field.removeprefix(ENGINES_FIELD).split(",")
    for entry in entries:
        bare = entry.removesuffix(WILDCARD)
        if not (ENGINE_ID.fullmatch(bare) or (bare == "" and entry == WILDCARD)):
            raise SecurityConfigError(
                f"{where}: {entry[:40]!r} in engines= is not an engine id "
                "(1-128 characters of [A-Za-z0-9._:-]), a prefix ending in *, or *"
            )
    return Binding.of(entries)


def _token_line(fields: list[str], where: str, number: int) -> tuple[str, Token]:
    """``TOKEN`` (the old format: named token-N, every scope, no engine), or
    ``NAME TOKEN [SCOPE,...] [engines=ID,...]``."""
    source = where
    if len(fields) == 1:
        secret = _checked_token(fields[0], f"{where}: token {number}")
        return secret, Token(f"token-{number}", source=source)
    engines = UNBOUND
    if fields[-1].startswith(ENGINES_FIELD) and len(fields) > 2:
        engines = _engines(fields.pop(), f"{where}: token {number} ({fields[0][:64]})")
    if len(fields) > 3:
        raise SecurityConfigError(
            f"{where}: line of token {number}: expected NAME TOKEN [SCOPE,...] "
            f"[engines=ID,...], got {len(fields) + (engines is not UNBOUND)} fields"
        )
    name = fields[0]
    if not TOKEN_NAME.fullmatch(name):
        raise SecurityConfigError(
            f"{where}: token {number}: its name must be 1-64 characters of [A-Za-z0-9._-]"
        )
    secret = _checked_token(fields[1], f"{where}: token {number} ({name})")
    scopes = ALL_SCOPES
    if len(fields) == 3:
        scopes = frozenset(fields[2].split(","))
        unknown = scopes - ALL_SCOPES
        if unknown:
            raise SecurityConfigError(
                f"{where}: token {number} ({name}): unknown scope {', '.join(sorted(unknown))} "
                f"(known: {', '.join(sorted(ALL_SCOPES))})"
            )
    return secret, Token(name, scopes, engines, source)


def load_tokens(settings: Settings) -> TokenSet | None:
    """Tokens from ``tokens`` and ``token_file`` together; None when neither is set.

    Several tokens may be valid at once: to rotate, add the new one, move
    the clients over, then remove the old one (each change needs a restart).
    A token's name is its holder's identity, for the per-identity limits.
    """
    tokens: list[tuple[str, Token]] = []
    if settings.tokens:
        parts = [t.strip() for t in settings.tokens.split(",")]
        for number, token in enumerate((t for t in parts if t), 1):
            tokens.append(
                (_checked_token(token, f"tokens: token {number}"), Token(f"env-{number}"))
            )
    if settings.token_file:
        where = f"token_file {settings.token_file}"
        text = _read(settings.token_file, "token_file").decode("utf-8", "replace")
        lines = (line.split("#", 1)[0].split() for line in text.splitlines())
        for number, fields in enumerate((f for f in lines if f), 1):
            tokens.append(_token_line(fields, where, number))
    if not settings.tokens and not settings.token_file:
        return None
    if not tokens:
        raise SecurityConfigError("tokens / token_file are set but hold no token")
    return TokenSet(tokens)


def authenticate(tokens: TokenSet, metadata: Iterable[tuple[str, str | bytes]]) -> Token | str:
    """The token's holder, or why the call's credentials are refused.

    The reasons never echo what was sent.
    """
    values = [value for key, value in metadata if key == "authorization"]
    if not values:
        return "missing authorization metadata (expected 'Bearer <token>')"
    if len(values) > 1:
        return "more than one authorization header"
    value = values[0]
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    match = BEARER.fullmatch(text.strip())
    if match is None:
        return "authorization must be 'Bearer <token>'"
    return tokens.identify(match.group(1)) or "invalid bearer token"


# --- engine identity --------------------------------------------------------------


San = tuple[str, str]  # (type, value): ("DNS", "prefill-0.engines"), ("URI", "spiffe://...")


def typed_san(entry: str, where: str, engine_id: str) -> San:
    """An identity file's SAN: ``DNS:name`` or ``URI:uri`` as written, and
    without a prefix a URI when it has a scheme (``://``), else a DNS name."""
    kind, colon, value = entry.partition(":")
    if colon and kind.upper() in SAN_PROPERTIES and not value.startswith("//"):
        if not value:
            raise SecurityConfigError(f"{where}: engine {engine_id} has an empty {kind} SAN")
        return kind.upper(), value
    if colon and kind.upper() in ("EMAIL", "IP", "IP ADDRESS", "RID", "DIRNAME", "OTHERNAME"):
        raise SecurityConfigError(
            f"{where}: engine {engine_id}: {kind} SANs do not identify an engine (DNS or URI only)"
        )
    return ("URI" if "://" in entry else "DNS"), entry


class EngineIdentities:
    """Which client-certificate SANs, by type, may act for which engine ids."""

    def __init__(
        self, engines_by_san: Mapping[San, frozenset[str]], source: str = "engine_identity_file"
    ) -> None:
        self._engines_by_san = dict(engines_by_san)
        self.source = source  # "engine_identity_file PATH", named in refusals

    def __len__(self) -> int:
        return len({e for engines in self._engines_by_san.values() for e in engines})

    def engines_for(self, sans: Iterable[San]) -> frozenset[str]:
        found: set[str] = set()
        for san in sans:
            found |= self._engines_by_san.get(san, frozenset())
        return frozenset(found)

    @classmethod
    def parse(cls, text: str, where: str) -> EngineIdentities:
        """``{"prefill-0": ["prefill-0.engines.svc", "URI:spiffe://..."], ...}``."""
        try:
            document = json.loads(text)
        except ValueError as error:
            raise SecurityConfigError(f"{where}: not JSON ({error})") from None
        if not isinstance(document, dict) or not document:
            raise SecurityConfigError(f"{where}: expected a non-empty object engine id -> SANs")
        by_san: dict[San, set[str]] = {}
        for engine_id, sans in document.items():
            if not ENGINE_ID.fullmatch(engine_id):
                raise SecurityConfigError(
                    f"{where}: {engine_id[:40]!r} is not an engine id "
                    "(1-128 characters of [A-Za-z0-9._:-])"
                )
            if isinstance(sans, str):
                sans = [sans]
            if (
                not isinstance(sans, list)
                or not sans
                or not all(isinstance(s, str) and s for s in sans)
            ):
                raise SecurityConfigError(
                    f"{where}: engine {engine_id} needs a SAN or a non-empty list of SANs"
                )
            for san in sans:
                by_san.setdefault(typed_san(san, where, engine_id), set()).add(engine_id)
        return cls({san: frozenset(engines) for san, engines in by_san.items()}, where)


def load_identities(settings: Settings) -> EngineIdentities | None:
    if not settings.engine_identity_file:
        return None
    path = settings.engine_identity_file
    text = _read(path, "engine_identity_file").decode("utf-8", "replace")
    return EngineIdentities.parse(text, f"engine_identity_file {path}")


def certificate_identity(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """A verified client certificate's first DNS or URI SAN, as the caller's
    identity for the per-identity limits. A certificate without one is
    identified by its SHA-256 fingerprint: else no per-identity limit would
    apply to it. None without a certificate."""
    for kind, name in SAN_PROPERTIES.items():
        for value in auth_context.get(name, ()):
            return f"certificate {kind}:{value.decode('utf-8', 'replace')[:128]}"
    for pem in auth_context.get("x509_pem_cert", ()):
        try:
            der = ssl.PEM_cert_to_DER_cert(pem.decode("ascii", "replace"))
        except ValueError:
            der = pem
        return f"certificate sha256:{hashlib.sha256(der).hexdigest()}"
    return None
