"""This process's shard: its identity, the shard map it serves, and who owns a new id.

A sharded coordinator is N processes (a StatefulSet's pods) that each own the
handoffs they started, for life. Nothing is shared between them: placement
is a pure function of the handoff id and the placing shards' names
(handoff_client.placement, the same code the routing client runs), so a
shard only has to refuse a StartHandoff it would not win. An id it already
holds is answered whatever the map says now: a retried start after the
map changed, and every later call, go on where the handoff lives.

Names are ``<prefix>-<K>`` and stable; addresses are not, so they are only
looked up when a client asks for the map (GetShardMap), from the address
template or from a JSON file that is re-read whenever it changes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from handoff_client.placement import ShardInfo, ShardMap, place
from handoff_server.domain.model import FailedPrecondition
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics

log = logging.getLogger("handoff.shards")

DEFAULT_PREFIX = "handoff"
# A StatefulSet pod's hostname: the set's name, a dash, the pod's ordinal.
ORDINAL_HOSTNAME = re.compile(r"(?P<prefix>.+)-(?P<ordinal>[0-9]+)")


class ShardSettingsError(ValueError):
    """The shard identity cannot be worked out: the server must not start."""


class Misrouted(FailedPrecondition):
    """A StartHandoff for an id another shard wins; ``owner`` names that shard."""

    def __init__(self, owner: str, message: str) -> None:
        super().__init__(message)
        self.owner = owner


@dataclass(frozen=True, slots=True)
class ShardIdentity:
    """Who this process is among the shards, and which of them place new handoffs."""

    ordinal: int
    names: tuple[str, ...]  # every shard's, in ordinal order
    placing: tuple[str, ...]  # names[:placing_shards]

    @property
    def name(self) -> str:
        return self.names[self.ordinal]

    @classmethod
    def resolve(cls, settings: Settings, hostname: str) -> ShardIdentity:
        """From the settings, the hostname filling in what they leave out."""
        count = settings.shard_count
        host = hostname.partition(".")[0]  # a pod's FQDN starts with its name
        from_host = ORDINAL_HOSTNAME.fullmatch(host)
        if settings.shard_ordinal >= 0:
            ordinal = settings.shard_ordinal
        elif count == 1:
            ordinal = 0
        elif from_host is None:
            raise ShardSettingsError(
                f"shard_count is {count} but this shard's ordinal is unknown: the hostname "
                f"{hostname!r} does not end in -K (a StatefulSet pod's does); set "
                "--shard-ordinal or HANDOFF_SHARD_ORDINAL"
            )
        else:
            ordinal = int(from_host["ordinal"])
        if ordinal >= count:
            raise ShardSettingsError(
                f"this shard's ordinal is {ordinal} (from the "
                f"{'hostname ' + repr(hostname) if settings.shard_ordinal < 0 else 'settings'}) "
                f"but shard_count is {count}: ordinals go from 0 to {count - 1}"
            )
        prefix = settings.shard_name_prefix or (
            from_host["prefix"] if from_host is not None else DEFAULT_PREFIX
        )
        names = tuple(f"{prefix}-{k}" for k in range(count))
        return cls(ordinal, names, names[: settings.placing_shards or count])


class Shards:
    """The shard this server is: it refuses misrouted starts and answers the map."""

    def __init__(self, settings: Settings, identity: ShardIdentity, metrics: Metrics) -> None:
        self.identity = identity
        self._template = settings.shard_address_template
        self._map_file = Path(settings.shard_map) if settings.shard_map else None
        self._misrouted = metrics.misrouted_starts
        self._sharded = len(identity.names) > 1
        self.port = settings.port  # the bound one once serving (app.py)
        self._file_addresses: dict[str, str] = {}
        self._file_version: tuple[int, int, int] | None = None
        metrics.shard_info.labels(identity.name).set(1)
        if self._map_file is not None:
            self._reload(self._map_file, at_start=True)

    @classmethod
    def single(cls, metrics: Metrics) -> Shards:
        """A single coordinator with the default settings: one shard, every id its own."""
        settings = Settings()
        return cls(settings, ShardIdentity.resolve(settings, DEFAULT_PREFIX), metrics)

    def check_start(self, handoff_id: str, held: bool) -> None:
        """Refuse a new id another shard wins under this shard's own map.

        ``held``: this shard already has the id (a retried start), which it
        answers wherever placement would put the id now.
        """
        if not self._sharded or held:
            return
        identity = self.identity
        owner = place(handoff_id, identity.placing)
        if owner != identity.name:
            self._misrouted.inc()
            raise Misrouted(
                owner,
                f"placed on shard {owner}, not {identity.name} (rendezvous over "
                f"{len(identity.placing)} placing shards); route it there",
            )

    def shard_map(self) -> ShardMap:
        """Every shard with its current address, in ordinal order."""
        if self._map_file is not None:
            self._reload(self._map_file, at_start=False)
        identity = self.identity
        placing = set(identity.placing)
        return ShardMap(
            tuple(
                ShardInfo(name, self._address(ordinal, name), name in placing)
                for ordinal, name in enumerate(identity.names)
            )
        )

    def _address(self, ordinal: int, name: str) -> str:
        if self._map_file is not None:
            return self._file_addresses.get(name, "")
        return self._template.format(name=name, ordinal=ordinal, port=self.port)

    def _reload(self, path: Path, *, at_start: bool) -> None:
        """Read the map file if it changed; a bad one is an error at start, later a warning."""
        try:
            stat = path.stat()
            version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if version == self._file_version:
                return
            addresses = _parse_map(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            if at_start:
                raise ShardSettingsError(f"shard map {path}: {error}") from error
            log.warning("shard map %s unreadable, keeping the previous one: %s", path, error)
            return
        missing = [name for name in self.identity.names if name not in addresses]
        if missing:
            log.warning("shard map %s has no address for %s", path, ", ".join(missing))
        self._file_addresses, self._file_version = addresses, version
        log.info("shard map %s read: %d addresses", path, len(addresses))


def _parse_map(text: str) -> dict[str, str]:
    raw = json.loads(text)
    if not isinstance(raw, dict) or not all(
        isinstance(name, str) and isinstance(address, str) for name, address in raw.items()
    ):
        raise ValueError('expected a JSON object {"shard-name": "host:port", ...}')
    return raw


def hostname() -> str:
    """The pod's name on Kubernetes (a StatefulSet's pod: <set>-<ordinal>)."""
    return os.uname().nodename
