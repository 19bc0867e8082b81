"""The sidecar's own thread and event loop, inside vLLM's engine-core process.

Why a thread of the scheduler's process and not a subprocess: the handlers
act on the scheduler's state (which requests are held, which may load), and
a subprocess would need its own channel into the scheduler for every step.
Why not the scheduler's thread: vLLM's scheduler loop is synchronous and,
while a prefill holds delayed-free blocks, spins. A thread of its own gets
the GIL at least every ``sys.getswitchinterval()`` (5 ms) from a spinning
Python loop and at every torch kernel, which releases it; the lease needs a
sign of life every few seconds. tests/vllm/test_faults.py's kill of the
decode holds a prefill for longer than the lease and passes; but the demo
and the benchmark saw this thread go 8 s without a heartbeat while its
engine held blocks (bench/RESULTS.md): open, and if it is the GIL, the
answer is a sidecar process of its own beside the engine core.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from handoff_client import EngineSidecar, HandoffClient
from handoff_vllm.engine import HandoffEngine
from handoff_vllm.settings import Settings

log = logging.getLogger("handoff.vllm")
STOP_GRACE_S = 5.0


class SidecarThread:
    """Runs ``EngineSidecar(client, engine_id, engine)`` on a loop of its own."""

    def __init__(self, settings: Settings, engine: HandoffEngine) -> None:
        self._settings = settings
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="handoff-sidecar", daemon=True)

    def start(self) -> None:
        self._thread.start()
        # Only the loop's own objects: a coordinator that is down does not hold the engine up.
        self._started.wait(timeout=30.0)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        stop = self._stop
        if stop is not None:
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=STOP_GRACE_S + 5.0)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        except Exception:
            log.exception("the handoff sidecar of engine %s stopped", self._settings.engine_id)
        finally:
            self._loop.close()

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        settings = self._settings
        client = HandoffClient(settings.coordinator, **settings.client_options())
        sidecar = EngineSidecar(client, settings.engine_id, self._engine, stop_grace_s=STOP_GRACE_S)
        self._engine.attach(asyncio.get_running_loop(), client, sidecar.facts)
        self._started.set()
        async with client, sidecar:
            log.info(
                "handoff sidecar of engine %s started (coordinator %s, incarnation %s)",
                settings.engine_id,
                settings.coordinator,
                sidecar.incarnation,
            )
            await self._stop.wait()
