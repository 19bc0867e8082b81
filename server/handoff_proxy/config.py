"""`handoff proxy`'s flags, checked into a ProxyConfig.

Values are checked here, not by argparse's ``type=``, so that a bad one
prints one line naming its flag (argparse would print the usage first).
The command imports the aiohttp application only once the flags are good:
``handoff --help`` needs no ``[proxy]`` extra.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from handoff_server import coordinator_options
from handoff_server.coordinator_options import SecurityOptions

PROXY_EXTRA = "pip install 'handoff[proxy]'"


class ConfigError(ValueError):
    """A flag's value is unusable; the message starts with the flag."""


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """One vLLM engine: the id its connector's sidecar subscribes with, and its HTTP URL."""

    engine_id: str
    url: str  # scheme://host:port[/base], no trailing slash


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: tuple[EngineAddress, ...]
    decode: tuple[EngineAddress, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    coordinator: str = "localhost:50051"
    use_coordinator: bool = True  # False: --no-coordinator, plain vLLM P/D
    deadline_s: float = 30.0
    poll_interval_s: float = 0.5
    coordinator_timeout_s: float = 2.0
    coordinator_retry_s: float = 1.0
    connect_timeout_s: float = 5.0
    max_in_flight: int = 0  # per engine; 0: no limit
    max_body_bytes: int = 16 * 1024 * 1024
    drain_grace_s: float = 10.0
    log_format: str = "text"
    log_level: str = "info"
    security: SecurityOptions = field(
        default_factory=lambda: SecurityOptions(
            tls=None, tls_root_cert=None, tls_client_cert=None, tls_client_key=None, token=None
        )
    )


DEFAULTS = ProxyConfig(prefill=(), decode=())


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "proxy",
        help="an OpenAI-compatible frontend that runs vLLM prefill/decode under handoff",
        description=(
            "Serve /v1/completions and /v1/chat/completions (streaming or not) in front "
            "of vLLM prefill and decode engines. Each request becomes one handoff: the "
            "proxy picks the pair with the fewest requests in flight, calls StartHandoff, "
            "sends the prompt to the prefill (max_tokens 1, KV held), then to the decode "
            "with the prefill's kv_transfer_params, and streams the answer back. A client "
            "that disconnects cancels the handoff; a handoff the coordinator cancels "
            "closes the open leg. Also /health and /metrics. Guide: docs/proxy.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engines = parser.add_argument_group(
        "engines", "each ENGINE_ID is the id that engine's HandoffConnector subscribes with"
    )
    engines.add_argument(
        "--prefill",
        metavar="ENGINE_ID=URL",
        action="append",
        default=[],
        help="a prefill vLLM (kv_producer), e.g. prefill-0=http://10.0.0.5:8100; repeatable",
    )
    engines.add_argument(
        "--decode",
        metavar="ENGINE_ID=URL",
        action="append",
        default=[],
        help="a decode vLLM (kv_consumer), e.g. decode-0=http://10.0.0.6:8200; repeatable",
    )
    _value(
        engines,
        "--max-in-flight",
        DEFAULTS.max_in_flight,
        "N",
        "requests in flight per engine before it is passed over (503 when every "
        "engine of a role is at it); 0: no limit",
    )
    _value(
        engines,
        "--connect-timeout-s",
        DEFAULTS.connect_timeout_s,
        "S",
        "to open a connection to an engine",
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default=DEFAULTS.host, help="address to listen on")
    http.add_argument("--port", default=str(DEFAULTS.port), help="port to listen on (0: any)")
    _value(
        http,
        "--max-body-bytes",
        DEFAULTS.max_body_bytes,
        "N",
        "largest request body accepted (413 above)",
    )
    _value(
        http,
        "--drain-grace-s",
        DEFAULTS.drain_grace_s,
        "S",
        "on SIGTERM or SIGINT, how long requests in flight may take to finish; the "
        "rest are cut off and their handoffs canceled",
    )
    coordinator = parser.add_argument_group("coordinator")
    coordinator.add_argument(
        "--coordinator", default=DEFAULTS.coordinator, metavar="HOST:PORT", help="its address"
    )
    _value(
        coordinator,
        "--deadline-s",
        DEFAULTS.deadline_s,
        "S",
        "each handoff's deadline: past it the coordinator cancels it and the client gets 504",
    )
    _value(
        coordinator,
        "--poll-interval-s",
        DEFAULTS.poll_interval_s,
        "S",
        "how often a request with a leg open asks the coordinator (GetHandoff) "
        "whether its handoff was canceled: the delay before the proxy closes a "
        "canceled handoff's leg, at one call per request in flight per interval",
    )
    _value(
        coordinator,
        "--coordinator-timeout-s",
        DEFAULTS.coordinator_timeout_s,
        "S",
        "each coordinator call's deadline",
    )
    _value(
        coordinator,
        "--coordinator-retry-s",
        DEFAULTS.coordinator_retry_s,
        "S",
        "how long a call is retried while the coordinator is unreachable; then 503 "
        "(short: fail fast)",
    )
    coordinator.add_argument(
        "--no-coordinator",
        action="store_true",
        help="plain vLLM P/D: the same two legs, no StartHandoff, no watching, no "
        "cancel (for comparison; gives up what docs/proxy.md lists)",
    )
    coordinator_options.add_arguments(parser, scopes="`start`, `report` and `read` scopes")
    logs = parser.add_argument_group("logs")
    logs.add_argument("--log-format", choices=("text", "json"), default=DEFAULTS.log_format)
    logs.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default=DEFAULTS.log_level
    )
    parser.set_defaults(run=run)


def _value(
    group: argparse._ArgumentGroup, flag: str, default: float, metavar: str, text: str
) -> None:
    """A flag whose value from_arguments checks (``--help`` shows the default)."""
    group.add_argument(flag, default=str(default), metavar=metavar, help=text)


def run(args: argparse.Namespace) -> int:
    try:
        config = from_arguments(args)
    except (ConfigError, OSError) as error:
        print(f"handoff proxy: {error}", file=sys.stderr)
        return 2
    try:
        from handoff_proxy import app  # the [proxy] extra, only now
    except ModuleNotFoundError as error:
        if error.name is None or error.name.startswith("handoff"):
            raise
        print(
            f"handoff proxy: needs module {error.name!r}; install it with: {PROXY_EXTRA}",
            file=sys.stderr,
        )
        return 2
    return app.run(config)


def from_arguments(args: argparse.Namespace) -> ProxyConfig:
    prefill = engines("--prefill", args.prefill)
    decode = engines("--decode", args.decode)
    try:
        security = coordinator_options.security_options(args)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if security["tls_client_cert"] is None and security["tls_client_key"] is not None:
        raise ConfigError("--tls-client-key: needs --tls-client-cert (mutual TLS)")
    if security["tls_client_cert"] is not None and security["tls_client_key"] is None:
        raise ConfigError("--tls-client-cert: needs --tls-client-key (mutual TLS)")
    return ProxyConfig(
        prefill=prefill,
        decode=decode,
        host=args.host,
        port=integer("--port", args.port, low=0, high=65535),
        coordinator=address("--coordinator", args.coordinator),
        use_coordinator=not args.no_coordinator,
        deadline_s=seconds("--deadline-s", args.deadline_s),
        poll_interval_s=seconds("--poll-interval-s", args.poll_interval_s),
        coordinator_timeout_s=seconds("--coordinator-timeout-s", args.coordinator_timeout_s),
        coordinator_retry_s=seconds("--coordinator-retry-s", args.coordinator_retry_s, zero=True),
        connect_timeout_s=seconds("--connect-timeout-s", args.connect_timeout_s),
        max_in_flight=integer("--max-in-flight", args.max_in_flight, low=0),
        max_body_bytes=integer("--max-body-bytes", args.max_body_bytes, low=1),
        drain_grace_s=seconds("--drain-grace-s", args.drain_grace_s, zero=True),
        log_format=args.log_format,
        log_level=args.log_level,
        security=security,
    )


def engines(flag: str, values: list[str]) -> tuple[EngineAddress, ...]:
    if not values:
        raise ConfigError(f"{flag}: give at least one ENGINE_ID=URL")
    parsed: list[EngineAddress] = []
    for value in values:
        engine_id, equals, url = value.partition("=")
        engine_id = engine_id.strip()
        if not equals or not engine_id:
            raise ConfigError(f"{flag}: {value!r} is not ENGINE_ID=URL")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{flag}: {url!r} is not an http:// or https:// URL")
        if parts.query or parts.fragment:
            raise ConfigError(f"{flag}: {url!r} has a query or fragment; give the base URL")
        if any(engine.engine_id == engine_id for engine in parsed):
            raise ConfigError(f"{flag}: engine id {engine_id!r} is given twice")
        parsed.append(EngineAddress(engine_id, url.rstrip("/")))
    return tuple(parsed)


def seconds(flag: str, value: str, *, zero: bool = False) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{flag}: {value!r} is not a number of seconds") from None
    if not (number >= 0 if zero else number > 0) or number == float("inf"):
        raise ConfigError(f"{flag}: must be {'>= 0' if zero else '> 0'} and finite, got {value}")
    return number


def integer(flag: str, value: str, *, low: int, high: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{flag}: {value!r} is not an integer") from None
    if number < low or (high is not None and number > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{flag}: must be {bound}, got {value}")
    return number


def address(flag: str, value: str) -> str:
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ConfigError(f"{flag}: {value!r} is not HOST:PORT")
    return value
