"""Server settings: one frozen dataclass, each field a flag and a HANDOFF_* variable.

Precedence: command-line flag, then environment variable, then the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from handoff_server.domain.model import MAX_HANDOFF_TIMEOUT_S


def _setting(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = _setting("127.0.0.1", "address the gRPC server binds; 0.0.0.0 for every interface")
    port: int = _setting(50051, "gRPC port (0 picks a free one)")
    metrics_host: str = _setting(
        "127.0.0.1", "address the Prometheus metrics endpoint binds; 0.0.0.0 for every interface"
    )
    metrics_port: int = _setting(9464, "metrics HTTP port (0 picks a free one; -1 disables)")
    default_timeout_s: float = _setting(
        300.0, "handoff deadline when StartHandoff gives none, in seconds"
    )
    delivery_timeout_s: float = _setting(
        10.0, "fail a handoff whose engine has had no live stream for this long, in seconds"
    )
    heartbeat_s: float = _setting(
        0.0,
        "an engine's stream idle this long gets a heartbeat (sidecars that ask run their "
        "lease on them), in seconds; 0: a fifth of delivery_timeout_s",
    )
    cleanup_timeout_s: float = _setting(
        300.0, "abandon a handoff still cleaning up after this long, in seconds"
    )
    cleanup_redelivery_s: float = _setting(
        1.0, "first redelivery delay of an unacknowledged cleanup action (doubles, max 30 s)"
    )
    retention_s: float = _setting(
        600.0, "keep completed handoffs this long for late reports and id reuse checks"
    )
    max_retained: int = _setting(100_000, "completed handoffs kept at most (oldest evicted)")
    max_active_handoffs: int = _setting(
        100_000, "handoffs not yet complete at most; past it StartHandoff is refused"
    )
    max_queued_actions_per_engine: int = _setting(
        10_000, "undelivered actions per engine at most; past it StartHandoff is refused"
    )
    require_known_engines: bool = _setting(
        False,
        "refuse (FAILED_PRECONDITION) a StartHandoff naming an engine that has not "
        "subscribed since this server started; off: such starts are counted and logged",
    )
    drain_grace_s: float = _setting(
        20.0, "on SIGTERM, wait this long for active handoffs before canceling them"
    )
    otlp_endpoint: str = _setting(
        "",
        "export traces over OTLP/gRPC to this collector (http://host:4317); empty: tracing "
        "off, unless OTEL_EXPORTER_OTLP_ENDPOINT is set. Other OTEL_* variables apply",
    )
    log_format: str = _setting("text", "log format", choices=("text", "json"))
    log_level: str = _setting("info", "log level", choices=("debug", "info", "warning", "error"))
    event_loop: str = _setting(
        "asyncio",
        "event loop; uvloop spends less server CPU per handoff (bench/RESULTS.md)",
        choices=("asyncio", "uvloop"),
    )
    stream_linger_ms: float = _setting(
        1.0,
        "while the event loop is behind (a stream woke more than half this late), at most "
        "one write per engine stream per this many ms, so one message carries more acks and "
        "actions (less CPU per handoff; an action waits up to this much longer); on a loop "
        "that keeps up no stream lingers; 0: never",
    )
    # --- durability (docs/durability.md) ----------------------------------------
    state_dir: str = _setting(
        "",
        "directory of the journal that lets a restarted server recover its handoffs; "
        "'' keeps them in memory only",
    )
    durability: str = _setting(
        "normal",
        "normal: a commit survives the process dying; full: also the machine (fsync per commit)",
        choices=("normal", "full"),
    )
    journal_commit_delay_ms: float = _setting(
        2.0,
        "under load, at most one journal commit per this many ms, so one commit holds "
        "more calls (less CPU per call, up to this much more latency); an idle server "
        "commits at once; 0: commit as soon as the previous commit ends",
    )
    journal_reserve_mib: int = _setting(
        64,
        "refuse new handoffs (RESOURCE_EXHAUSTED) while the state dir's volume has less "
        "than this many MiB left for the journal, so the handoffs in flight can still be "
        "journaled to their end; 0: never refuse (a full volume then stops the server)",
    )
    journal_busy_timeout_s: float = _setting(
        5.0,
        "a journal commit waits this long for another process's write transaction on the "
        "journal (the event loop serves meanwhile), then the server drains and exits 1, "
        "in seconds",
    )
    # --- sharding (docs/sharding.md) --------------------------------------------
    shard_count: int = _setting(1, "coordinator shards in all; 1 is a single coordinator")
    shard_ordinal: int = _setting(
        -1, "this shard's ordinal, 0 to shard_count-1; -1: the hostname's trailing -K"
    )
    shard_name_prefix: str = _setting(
        "",
        "shard names are PREFIX-K; '': the hostname without its trailing -K "
        "(the StatefulSet's name), or 'handoff'",
    )
    shard_address_template: str = _setting(
        "{name}.handoff-shards:{port}",
        "the address clients dial for each shard; {name}, {ordinal} and {port} are filled in",
    )
    shard_map: str = _setting(
        "",
        "JSON file {name: host:port} of the shards' addresses, re-read when it changes; "
        "overrides shard_address_template",
    )
    placing_shards: int = _setting(
        0, "new handoffs are placed on shards 0 to this-1 only, the rest drain; 0: all"
    )
    # --- security (README "Security"); file paths: "" means unset -------------
    tls_cert: str = _setting(
        "", "PEM certificate chain; with --tls-key the gRPC port speaks TLS only"
    )
    tls_key: str = _setting("", "PEM private key of --tls-cert (unencrypted)")
    tls_client_ca: str = _setting(
        "", "PEM CA bundle; clients must present a certificate it signed (mutual TLS)"
    )
    token_file: str = _setting(
        "",
        "file of accepted bearer tokens, one per line: NAME TOKEN [SCOPE,...] "
        "[engines=ID,...], the engines it may act for, none without (docs/limits.md; "
        "a bare TOKEN still works, as a frontend's; '#' starts a comment)",
    )
    # Not in repr: Settings may be logged, and this holds secrets.
    tokens: str = field(
        default="",
        repr=False,
        metadata={
            "help": "accepted bearer tokens, comma-separated, acting for no engine; prefer "
            "the variable or --token-file (a flag is visible in the process list)"
        },
    )
    auth_exempt_methods: str = _setting(
        "/grpc.health.v1.Health/Check",
        "comma-separated gRPC method prefixes callable without a token ('' for none)",
    )
    engine_identity_file: str = _setting(
        "",
        "JSON object: engine id -> list of client-certificate SANs (DNS:name or URI:uri) "
        "that may act for it (needs --tls-client-ca)",
    )
    max_message_bytes: int = _setting(
        65536, "largest request message accepted, in bytes; larger ones get RESOURCE_EXHAUSTED"
    )
    max_concurrent_streams: int = _setting(
        1000, "calls in flight per client connection (HTTP/2 streams); more wait at the client"
    )
    max_concurrent_rpcs: int = _setting(
        10_000,
        "the service's calls in flight (health has its own), engine streams included; "
        "past it RESOURCE_EXHAUSTED",
    )
    max_engines: int = _setting(
        1000, "engines with a live action stream at most; a new engine past it is refused"
    )
    keepalive_time_s: float = _setting(
        20.0, "ping a client connection after this long without traffic (dead-peer detection)"
    )
    keepalive_timeout_s: float = _setting(
        10.0, "close a connection whose keepalive ping is unanswered for this long"
    )
    keepalive_min_client_interval_s: float = _setting(
        10.0, "clients may ping this often at most; faster pingers are disconnected"
    )
    max_connection_age_s: float = _setting(
        3600.0, "close a client connection after this long (clients reconnect); 0 disables"
    )
    max_connection_age_grace_s: float = _setting(
        30.0, "then give its calls this long to finish before they are cut, in seconds"
    )
    max_calls_per_identity: int = _setting(
        1000,
        "calls in flight per caller identity (token name or certificate SAN); an engine's "
        "streams count once per engine id",
    )
    max_engines_per_identity: int = _setting(
        128,
        "engines with a live stream per caller identity, at most; give each sidecar its "
        "own token (or certificate), or raise this for one identity shared by more engines",
    )
    max_active_handoffs_per_identity: int = _setting(
        20_000, "handoffs not yet complete that one caller identity started, at most"
    )
    max_starts_per_s_per_identity: float = _setting(
        200.0,
        "StartHandoff calls per second per caller identity (bursts of one second's worth); "
        "about half of what one shard serves (docs/limits.md)",
    )
    max_calls_per_s_per_identity: float = _setting(
        1000.0,
        "calls of any RPC per second per caller identity, counted as they arrive (bursts of "
        "one second's worth); about two thirds of the unary calls one shard serves",
    )
    rate_wait_s: float = _setting(
        1.0,
        "a call past its identity's calls per second waits for its turn up to this long "
        "(never past its deadline) before it is refused; 0 refuses at once",
    )
    max_reports_per_s_per_identity: float = _setting(
        2000.0,
        "reports carried by Connect messages per second per caller identity (bursts of one "
        "second's worth); past it the identity's streams are read more slowly",
    )
    max_health_checks: int = _setting(
        32, "health Check calls in flight per port, apart from the service's calls"
    )
    max_health_watches: int = _setting(
        16, "health Watch streams per port, apart from the service's calls and the checks"
    )
    request_within_s: float = _setting(
        10.0,
        "end a service call whose first message (Connect's hello) has not arrived within "
        "this, in seconds; until then it holds one of half the call slots",
    )
    health_request_within_s: float = _setting(
        1.0, "end a health call whose request has not arrived within this, in seconds"
    )
    health_host: str = _setting(
        "127.0.0.1", "address the plaintext health port binds; 0.0.0.0 for every interface"
    )
    health_port: int = _setting(
        -1,
        "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS "
        "(the kubelet's); -1 disables, 0 picks a free one",
    )

    @property
    def heartbeat_interval_s(self) -> float:
        """How long an engine's stream stays idle before it gets a heartbeat.

        A fifth of the delivery timeout by default: a sidecar's lease expires
        a margin (20 %, at least 1 s) before the delivery timeout, so even a
        heartbeat or two lost to a slow network leaves it several signs of
        life within its lease; more often would only cost idle streams.
        """
        return self.heartbeat_s or self.delivery_timeout_s / 5

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{setting.name} must be finite and >= 0, got {value}")
            choices = setting.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{setting.name} must be one of {', '.join(choices)}")
        if not 0.0 < self.default_timeout_s <= MAX_HANDOFF_TIMEOUT_S:
            raise ValueError(
                f"default_timeout_s must be > 0 and at most {MAX_HANDOFF_TIMEOUT_S:.0f}"
            )
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be 0 (any free port) to {MAX_PORT}, got {self.port}")
        for name in ("metrics_port", "health_port"):
            port = getattr(self, name)
            if not -1 <= port <= MAX_PORT:
                raise ValueError(
                    f"{name} must be -1 (off), 0 (any free port) to {MAX_PORT}, got {port}"
                )
        if self.otlp_endpoint and importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError(
                "otlp_endpoint needs OpenTelemetry: pip install 'kv-handoff[server,otel]'"
            )
        for name in ("max_retained", "max_active_handoffs", "max_queued_actions_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        self._check_journal()
        self._check_shards()
        self._check_security()

    def _check_journal(self) -> None:
        if self.journal_reserve_mib != 0 and self.journal_reserve_mib < MIN_JOURNAL_RESERVE_MIB:
            # The write-ahead log alone grows to about 16 MiB between checkpoints.
            raise ValueError(
                f"journal_reserve_mib must be 0 (never refuse) or at least "
                f"{MIN_JOURNAL_RESERVE_MIB}, got {self.journal_reserve_mib}"
            )
        if self.journal_busy_timeout_s == 0:
            raise ValueError("journal_busy_timeout_s must be > 0")

    def _check_shards(self) -> None:
        """The shard identity that can be checked without the hostname (shards.py)."""
        if self.shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {self.shard_count}")
        if not -1 <= self.shard_ordinal < self.shard_count:
            raise ValueError(
                f"shard_ordinal must be 0 to shard_count-1 ({self.shard_count - 1}), "
                f"or -1 (from the hostname); got {self.shard_ordinal}"
            )
        if not 0 <= self.placing_shards <= self.shard_count:
            raise ValueError(
                f"placing_shards must be 1 to shard_count ({self.shard_count}), or 0 (all); "
                f"got {self.placing_shards}"
            )

    def _check_security(self) -> None:
        """Combinations that cannot work; the files themselves are read at start."""
        for name in (
            "max_message_bytes",
            "max_concurrent_streams",
            "max_concurrent_rpcs",
            "max_engines",
            "max_health_checks",
            "max_health_watches",
            "max_calls_per_identity",
            "max_engines_per_identity",
            "max_active_handoffs_per_identity",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_concurrent_rpcs <= self.max_engines:
            # Every engine holds a call open; frontends need room besides.
            raise ValueError("max_concurrent_rpcs must be larger than max_engines")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.engine_identity_file and not self.tls_client_ca:
            raise ValueError("engine_identity_file needs mutual TLS (tls_client_ca)")
        for name in (
            "max_starts_per_s_per_identity",
            "max_calls_per_s_per_identity",
            "max_reports_per_s_per_identity",
            "request_within_s",
            "health_request_within_s",
        ):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0")
        if self.keepalive_time_s == 0 or self.keepalive_timeout_s == 0:
            raise ValueError("keepalive_time_s and keepalive_timeout_s must be > 0")


MAX_PORT = 65535
# Twice the journal's write-ahead log at its checkpoint size (journal.py;
# tests/durability/test_journal.py holds the two together).
MIN_JOURNAL_RESERVE_MIB = 32
# What Kubernetes puts in HANDOFF_PORT (and HANDOFF_PORT_50051_TCP, ...) for a
# Service named "handoff" in the namespace, unless enableServiceLinks is off.
SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://", re.IGNORECASE)


def _parser(default: object) -> Any:
    return parse_bool if isinstance(default, bool) else type(default)


def parse_bool(raw: str) -> bool:
    """A switch's value from a flag or a variable: bool("false") would be True."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def env_name(name: str) -> str:
    return "HANDOFF_" + name.upper()


# `serve --help` by topic: each group starts at its setting, in field order;
# the health port's settings sit with the other listeners.
TOPICS = {
    "host": "listeners",
    "default_timeout_s": "handoffs and engines",
    "otlp_endpoint": "logs, traces, event loop",
    "state_dir": "durability (docs/durability.md)",
    "shard_count": "sharding (docs/sharding.md)",
    "tls_cert": "security (docs/security.md)",
    "max_message_bytes": "limits (docs/limits.md)",
}
LISTENERS = ("health_host", "health_port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by topic; --help shows the default and the variable."""
    groups = {topic: parser.add_argument_group(topic) for topic in TOPICS.values()}
    group = groups["listeners"]
    for setting in fields(Settings):
        if setting.name in TOPICS:
            group = groups[TOPICS[setting.name]]
        # A switch alone turns it on; =false turns it off again.
        switch: dict[str, Any] = (
            {"nargs": "?", "const": True} if isinstance(setting.default, bool) else {}
        )
        (groups["listeners"] if setting.name in LISTENERS else group).add_argument(
            "--" + setting.name.replace("_", "-"),
            dest=setting.name,
            type=_parser(setting.default),
            choices=setting.metadata.get("choices"),
            default=None,
            help=f"{setting.metadata['help']} (default: {setting.default}; "
            f"env {env_name(setting.name)})",
            **switch,
        )


def service_links(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Setting variables holding a Kubernetes service link, which from_arguments ignores.

    A value like tcp://10.0.0.7:50051 is never an operator's: Kubernetes lets
    the pod's own env win over its service links, so it came from a Service
    that happens to be named "handoff".
    """
    return [
        env_name(setting.name)
        for setting in fields(Settings)
        if SERVICE_LINK.match(environ.get(env_name(setting.name), ""))
    ]


def from_arguments(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    values: dict[str, Any] = {}
    links = service_links(environ)
    for setting in fields(Settings):
        value = getattr(args, setting.name, None)
        variable = env_name(setting.name)
        if value is None and variable in environ and variable not in links:
            raw = environ[env_name(setting.name)]
            parse = _parser(setting.default)
            try:
                value = parse(raw)
            except ValueError as error:
                raise ValueError(f"{env_name(setting.name)}={raw!r}: {error}") from error
        if value is not None:
            values[setting.name] = value
    return dataclasses.replace(Settings(), **values)
