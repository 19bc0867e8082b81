"""Who may call the coordinator: TLS material, bearer tokens, engine identities.

Loaded once when the server starts, from the settings' files and variables;
a problem with any of them stops the start with a message naming the file.
The checks themselves run in :mod:`handoff_server.guard` (tokens, before any
handler) and in the servicer (engine identity, through :func:`authorize_engine`
and :func:`authorize_report`, inside the same synchronous step that changes
the handoff, so nothing can change between the check and the call).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import ssl
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import grpc

from handoff_server.config import Settings
from handoff_server.convert import ENGINE_ID
from handoff_server.model import Canceled, EngineLost, Fact, HandoffError
from handoff_server.registry import Entry, Retained

# RFC 6750 b64token: what an `Authorization: Bearer` header can carry.
TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
# Short tokens can be guessed; 16 characters of b64token are ~96 bits at best.
MIN_TOKEN_LENGTH = 16
BEARER = re.compile(r"bearer +(\S+)", re.IGNORECASE)
SAN_PROPERTY = "x509_subject_alternative_name"


class SecurityConfigError(OSError):
    """Unusable security material. An OSError, like an unreadable file, so that
    ``handoff serve`` reports it as "cannot start" and exits 1."""


class PermissionDenied(HandoffError):
    """The caller's certificate does not allow this call."""

    code = "PERMISSION_DENIED"


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


class TokenSet:
    """The accepted tokens, compared in constant time.

    Only SHA-256 digests are kept. A presented token is hashed and compared
    with every digest, without stopping at a match, so the time taken says
    nothing about which token, or which prefix of one, was close.
    """

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(t.encode()).digest() for t in tokens)
        if not self._digests:
            raise SecurityConfigError("token authentication is on but no token is configured")

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, presented: str) -> bool:
        digest = hashlib.sha256(presented.encode()).digest()
        found = False
        for accepted in self._digests:
            found |= hmac.compare_digest(accepted, digest)
        return found


def _checked_tokens(tokens: Iterable[str], where: str) -> list[str]:
    checked = []
    for number, token in enumerate(tokens, 1):
        if not TOKEN.fullmatch(token):
            raise SecurityConfigError(
                f"{where}: token {number} has characters a bearer token cannot carry "
                "(allowed: A-Z a-z 0-9 - . _ ~ + / and trailing =)"
            )
        if len(token) < MIN_TOKEN_LENGTH:
            raise SecurityConfigError(
                f"{where}: token {number} is shorter than {MIN_TOKEN_LENGTH} characters"
            )
        checked.append(token)
    return checked


def load_tokens(settings: Settings) -> TokenSet | None:
    """Tokens from ``tokens`` and ``token_file`` together; None when neither is set.

    Several tokens may be valid at once: to rotate, add the new one, move
    the clients over, then remove the old one (each change needs a restart).
    """
    tokens: list[str] = []
    if settings.tokens:
        parts = [t.strip() for t in settings.tokens.split(",")]
        tokens += _checked_tokens([t for t in parts if t], "tokens")
    if settings.token_file:
        text = _read(settings.token_file, "token_file").decode("utf-8", "replace")
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        tokens += _checked_tokens([t for t in lines if t], f"token_file {settings.token_file}")
    if not settings.tokens and not settings.token_file:
        return None
    if not tokens:
        raise SecurityConfigError("tokens / token_file are set but hold no token")
    return TokenSet(tokens)


def bearer_problem(tokens: TokenSet, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """Why the call's credentials are refused, or None when they are accepted.

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
    if not tokens.accepts(match.group(1)):
        return "invalid bearer token"
    return None


# --- engine identity --------------------------------------------------------------


class EngineIdentities:
    """Which client-certificate SANs may act for which engine ids."""

    def __init__(self, engines_by_san: Mapping[str, frozenset[str]]) -> None:
        self._engines_by_san = dict(engines_by_san)

    def __len__(self) -> int:
        return len({e for engines in self._engines_by_san.values() for e in engines})

    def engines_for(self, sans: Iterable[str]) -> frozenset[str]:
        found: set[str] = set()
        for san in sans:
            found |= self._engines_by_san.get(san, frozenset())
        return frozenset(found)

    @classmethod
    def parse(cls, text: str, where: str) -> EngineIdentities:
        """``{"prefill-0": ["prefill-0.engines.svc", "spiffe://..."], ...}``."""
        try:
            document = json.loads(text)
        except ValueError as error:
            raise SecurityConfigError(f"{where}: not JSON ({error})") from None
        if not isinstance(document, dict) or not document:
            raise SecurityConfigError(f"{where}: expected a non-empty object engine id -> SANs")
        by_san: dict[str, set[str]] = {}
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
                by_san.setdefault(san, set()).add(engine_id)
        return cls({san: frozenset(engines) for san, engines in by_san.items()})


def load_identities(settings: Settings) -> EngineIdentities | None:
    if not settings.engine_identity_file:
        return None
    path = settings.engine_identity_file
    text = _read(path, "engine_identity_file").decode("utf-8", "replace")
    return EngineIdentities.parse(text, f"engine_identity_file {path}")


@dataclass(frozen=True, slots=True)
class Caller:
    """The peer of one call, when engine identities are enforced."""

    sans: tuple[str, ...]
    engines: frozenset[str]  # empty: not an engine (a frontend)

    @classmethod
    def of(
        cls, identities: EngineIdentities, auth_context: Mapping[str, Iterable[bytes]]
    ) -> Caller:
        sans = tuple(v.decode("utf-8", "replace") for v in auth_context.get(SAN_PROPERTY, ()))
        return cls(sans, identities.engines_for(sans))

    def __str__(self) -> str:
        shown = ", ".join(s[:80] for s in self.sans[:4]) or "no SAN"
        return f"client certificate ({shown})"


# Set by the guard for every coordinator call when identities are enforced;
# None means the server enforces none. Each call runs in its own task, and
# the Connect report reader inherits its stream's value.
CALLER: ContextVar[Caller | None] = ContextVar("handoff_caller", default=None)


def authorize_engine(engine_id: str) -> str:
    """For StreamActions and Connect: the caller may subscribe as ``engine_id``."""
    caller = CALLER.get()
    if caller is not None and engine_id not in caller.engines:
        raise PermissionDenied(f"{caller} may not act for engine {engine_id}")
    return engine_id


def authorize_report(
    entry: Entry | Retained, *, fact: Fact | None = None, action_id: int | None = None
) -> None:
    """For ReportFact and ReportOutcome (also on Connect), before the registry call.

    An engine reports only for handoffs it takes part in, and outcomes only
    of actions addressed to it. A caller bound to no engine (a frontend) may
    report Canceled and EngineLost (a pod it knows died), and nothing else.
    """
    caller = CALLER.get()
    if caller is None:
        return
    if not caller.engines:
        if isinstance(fact, (Canceled, EngineLost)):
            return
        what = "outcomes" if action_id is not None else "this fact"
        raise PermissionDenied(f"{caller} is bound to no engine; only engines report {what}")
    if not caller.engines & {entry.source_engine_id, entry.destination_engine_id}:
        raise PermissionDenied(f"{caller} acts for no engine of this handoff")
    routed = entry.routed.get(action_id) if action_id is not None else None
    if routed is not None and not caller.engines.intersection(routed[2]):
        raise PermissionDenied(
            f"action {action_id} is addressed to {', '.join(routed[2])}, not to {caller}"
        )
