"""The engine core's end of the sidecar: a process beside it, the handlers here.

Why a process: vLLM's scheduler loop is synchronous and spins while a
prefill holds delayed-free blocks. A sidecar on a thread of that process
needs the GIL for every message it reads, and on a loaded machine each
hand-over of the GIL waits for the spinning thread to be given the CPU
again: heartbeats then lagged by seconds and the lease expired on an engine
that was alive (docs/integrating.md, "Where the sidecar runs"). So the
``EngineSidecar`` (stream, heartbeats, lease, reconcile) runs in
``python -m handoff_vllm.sidecar``, and only the handlers, which act on the
scheduler's state, run here, on a thread with its own loop: a slow GIL
delays an outcome, never a heartbeat.

The thread spawns the sidecar process (so the kernel kills it when this
thread ends, with the engine core: PR_SET_PDEATHSIG) and serves its calls.
A sidecar process that dies while the engine lives is taken for a lost
engine by the coordinator: what it held goes back to vLLM's own rules
(``HandoffEngine.orphaned``) and a new sidecar, a new incarnation, starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from handoff_client import Action, Fact, Facts
from handoff_vllm import channel as ch
from handoff_vllm.engine import HandoffEngine
from handoff_vllm.settings import Settings

log = logging.getLogger("handoff.vllm")
STOP_GRACE_S = 5.0  # the sidecar's own stop grace (sidecar.py)
RESPAWN_S = 1.0


class SidecarProcess:
    """Runs ``python -m handoff_vllm.sidecar`` beside the engine core and serves it."""

    def __init__(self, settings: Settings, engine: HandoffEngine) -> None:
        self._settings = settings
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._main, name="handoff-sidecar", daemon=True)
        self._channel: ch.Channel | None = None
        self._running: dict[int, asyncio.Task[None]] = {}
        self._lookup_ids = itertools.count()
        self._lookups: dict[int, asyncio.Future[str | None]] = {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Returns once the coordinator confirmed the sidecar's subscription, so
        vLLM reports healthy only as a live engine there; after
        ``subscribe_timeout_s`` without it, starts anyway and says what to check."""
        self._thread.start()
        self._started.wait(timeout=30.0)
        settings = self._settings
        if not self._subscribed.wait(timeout=settings.subscribe_timeout_s):
            log.warning(
                "engine %s: not subscribed to the coordinator at %s within %g s; vLLM starts "
                "anyway, and each handoff naming this engine is canceled (EngineLost) until "
                "the sidecar subscribes: check the coordinator's address, TLS and token "
                '(kv_connector_extra_config["handoff"]), or raise its "subscribe_timeout_s"',
                settings.engine_id,
                settings.coordinator,
                settings.subscribe_timeout_s,
            )

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        stop = self._stop
        if stop is not None:
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=STOP_GRACE_S + 10.0)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        except Exception:
            log.exception("the handoff sidecar of engine %s stopped", self._settings.engine_id)
        finally:
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
            self._loop.close()

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        self._engine.attach(asyncio.get_running_loop(), self._lookup, Facts(self._send_fact))
        while not self._stop.is_set():
            process, channel = await self._spawn()
            self._started.set()
            stopping = asyncio.ensure_future(self._stop.wait())
            serving = asyncio.ensure_future(self._serve(channel))
            await asyncio.wait({stopping, serving}, return_when=asyncio.FIRST_COMPLETED)
            if self._stop.is_set():
                channel.send(ch.STOP)
                await channel.drain()
                try:
                    await asyncio.wait_for(serving, STOP_GRACE_S + 5.0)
                except TimeoutError:
                    log.warning("the handoff sidecar did not stop in time: killed")
            stopping.cancel()
            await self._ended(process, channel)
            if self._stop.is_set():
                return
            log.error(
                "the handoff sidecar of engine %s exited (status %s) while the engine runs; "
                "the coordinator takes the engine for lost, and a new sidecar starts",
                self._settings.engine_id,
                process.returncode,
            )
            self._engine.orphaned("the engine's handoff sidecar exited")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), RESPAWN_S)

    async def _spawn(self) -> tuple[subprocess.Popen[bytes], ch.Channel]:
        ours, theirs = socket.socketpair()
        with theirs:
            # Started from this thread, which lives as long as the engine core
            # serves it: the sidecar's PR_SET_PDEATHSIG follows this thread.
            self.process = subprocess.Popen(  # noqa: ASYNC220 (a fork and exec, no wait)
                [
                    sys.executable,
                    "-m",
                    "handoff_vllm.sidecar",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        channel = await ch.Channel.open(ours)
        # The settings (a token among them) go over the channel, never argv or env.
        channel.send(ch.SETTINGS, self._settings)
        self._channel = channel
        return self.process, channel

    async def _ended(self, process: subprocess.Popen[bytes], channel: ch.Channel) -> None:
        self._channel = None
        channel.close()
        for task in list(self._running.values()):
            task.cancel()
        for future in self._lookups.values():
            if not future.done():
                future.set_result(None)
        self._lookups.clear()
        if process.poll() is None:
            process.kill()
        await asyncio.get_running_loop().run_in_executor(None, process.wait)

    async def _serve(self, channel: ch.Channel) -> None:
        """The sidecar's calls, until it closes the channel."""
        while (message := await channel.receive()) is not None:
            kind, *args = message
            if kind == ch.CALL:
                call_id, name, action = args
                self._running[call_id] = asyncio.ensure_future(
                    self._handle(channel, call_id, name, action)
                )
            elif kind == ch.CANCEL:
                task = self._running.get(args[0])
                if task is not None:
                    task.cancel()
            elif kind == ch.ANSWER:
                future = self._lookups.pop(args[0], None)
                if future is not None and not future.done():
                    future.set_result(args[1])
            elif kind == ch.STARTED:
                log.info("engine %s: sidecar incarnation %s", self._settings.engine_id, args[0])
            elif kind == ch.SUBSCRIBED:
                self._subscribed.set()
            else:
                log.error("unknown frame %r from the handoff sidecar", kind)

    async def _handle(self, channel: ch.Channel, call_id: int, name: str, action: Action) -> None:
        engine = self._engine
        try:
            if name not in ch.CALLABLE:
                raise ValueError(f"the sidecar called {name!r}, not a handler")
            value: Any
            if name == "complete":
                await engine.complete(action)
                value = None
            elif name == "held_handoffs":
                value = list(await engine.held_handoffs())
            else:
                value = await getattr(engine, name)(action, engine.facts)
        except asyncio.CancelledError:
            channel.send(ch.RESULT, call_id, ch.CANCELLED, None)
        except Exception as error:
            channel.send(ch.RESULT, call_id, ch.RAISED, f"{type(error).__name__}: {error}")
        else:
            # Sent before this task yields: a fact the handler queued follows it.
            channel.send(ch.RESULT, call_id, ch.OK, value)
        finally:
            self._running.pop(call_id, None)

    async def _send_fact(self, handoff_id: str, fact: Fact) -> None:
        channel = self._channel
        if channel is None:
            raise RuntimeError("the engine's handoff sidecar is not running")
        channel.send(ch.FACT, handoff_id, fact)

    async def _lookup(self, handoff_id: str) -> str | None:
        """Why ``handoff_id`` is gone on the coordinator, through the sidecar's client."""
        channel = self._channel
        if channel is None:
            return None
        lookup_id = next(self._lookup_ids)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._lookups[lookup_id] = future
        channel.send(ch.LOOKUP, lookup_id, handoff_id)
        return await future
