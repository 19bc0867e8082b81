"""Starts naming an engine that never subscribed here: counted, logged, or refused.

The coordinator accepts a StartHandoff before its engines connect (a
frontend may start first), but a name no sidecar ever used is more often a
typo or a stale engine list, and its handoff then waits out the delivery
timeout. So each such start is counted, the engine id logged once, and with
--require-known-engines refused at once. "Known" is per process: after a
restart, engines are known again once their sidecars resubscribe.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from handoff_server.domain.model import FailedPrecondition
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics

log = logging.getLogger("handoff.newcomers")

# Engine ids remembered (each, and each one logged), least recent out first:
# far above a fleet's engines, so only a stream of ever-new ids is forgotten.
REMEMBERED = 65_536


class UnknownEngine(FailedPrecondition):
    """A start naming an engine that never subscribed, under --require-known-engines."""


class Newcomers:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._known: OrderedDict[str, None] = OrderedDict()
        self._logged: OrderedDict[str, None] = OrderedDict()

    def subscribed(self, engine_id: str) -> None:
        _remember(self._known, engine_id)

    def check_start(self, engine_ids: Iterable[str]) -> None:
        """Count (and log, or refuse) a start naming engines never subscribed here."""
        unknown = sorted({e for e in engine_ids if e not in self._known})
        if not unknown:
            return
        self.metrics.unknown_engine_starts.inc()
        named = ", ".join(unknown)
        if self.settings.require_known_engines:
            raise UnknownEngine(
                f"engine {named} has not subscribed to this server since it started; "
                "start its sidecar first, or run without --require-known-engines"
            )
        for engine_id in unknown:
            if engine_id not in self._logged:
                _remember(self._logged, engine_id)
                log.warning(
                    "a handoff names engine %s, which has not subscribed since this server "
                    "started: its handoffs wait for it up to the delivery timeout "
                    "(--require-known-engines refuses such starts)",
                    engine_id,
                    extra={"engine_id": engine_id},
                )


def _remember(ids: OrderedDict[str, None], engine_id: str) -> None:
    ids[engine_id] = None
    ids.move_to_end(engine_id)
    while len(ids) > REMEMBERED:
        ids.popitem(last=False)
