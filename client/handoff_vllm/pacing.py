"""NIXL's progress thread paced instead of spinning a core per engine.

nixl 1.5.1's Python agent creates its UCX progress thread with a delay of
0 µs, hard-coded (``nixl._api.nixl_agent.__init__`` sets ``pthrDelay = 0``):
the thread polls its event descriptors with a zero timeout, so it runs
100 % of a core for as long as the engine lives, busy or idle. On a GPU
host with cores to spare that buys latency; on a CPU-only host it takes
the core the engine, its sidecar and the coordinator need: on this
project's 2-core machine the two engines' progress threads left nothing
else to run, and handlers waited 30 s for a CPU (bench/RESULTS.md).

The delay is the longest the thread sleeps when no event wakes it, not a
wait per transfer. Nothing in vLLM or NIXL sets it, so this wraps the one
call that takes it; where nixl is not the version this was read against,
nothing is changed and a warning says so.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

log = logging.getLogger("handoff.vllm")

PACED_NIXL = "1.5.1"
MARK = "_handoff_paced_us"


class _PacedBindings:
    """nixl's bindings module, but each agent made with ``delay_us`` as its
    progress thread's delay (everything else passes through)."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        setattr(self, MARK, delay_us)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # nixl's name
        config.pthrDelay = getattr(self, MARK)
        return self._bindings.nixlAgent(name, config)


def pace_progress_thread(delay_us: int) -> bool:
    """From now on, NIXL agents made in this process pace their progress thread
    at ``delay_us``; False (and nothing changed) where that cannot be done."""
    if delay_us <= 0:
        return False
    try:
        from importlib.metadata import version as installed

        found = installed("nixl")
        agent = importlib.import_module("nixl._api").nixl_agent
    except Exception as error:  # no usable NIXL here: nothing to pace
        log.warning("NIXL's progress thread not paced: nixl not importable (%s)", error)
        return False
    module = sys.modules.get(agent.__module__)
    bindings = getattr(module, "nixlBind", None)
    if found != PACED_NIXL or bindings is None:
        log.warning(
            "NIXL's progress thread not paced: nixl %s is not %s, which this was read "
            'against; its thread may spin a core (kv_connector_extra_config["handoff"]'
            '["nixl_progress_delay_us"])',
            found,
            PACED_NIXL,
        )
        return False
    if getattr(bindings, MARK, None) != delay_us:
        inner = bindings._bindings if isinstance(bindings, _PacedBindings) else bindings
        module.nixlBind = _PacedBindings(inner, delay_us)  # type: ignore[union-attr]
    return True
