"""The engine's sidecar process: ``python -m handoff_vllm.sidecar FD PARENT_PID``.

Started by the scheduler-side connector (runner.py) with the engine core's
own interpreter, it runs the product's ``EngineSidecar`` against the
coordinator: the Connect stream, the heartbeats, the lease and the
reconcile live here, in a process with its own GIL, so a vLLM scheduler
that spins (a held prefill keeps it stepping) cannot delay them, and in a
session of its own, so the CPU its engine's spinning workers are given is
not what its heartbeats wait for. Its engine is :class:`RemoteEngine`:
every handler call goes over the channel to the engine core, where
``HandoffEngine`` acts on vLLM's state, and the facts the engine core
reports come back the same way.

It lives and dies with the engine core: the kernel kills it when the thread
that started it ends (``PR_SET_PDEATHSIG``), and it exits at once when the
channel closes without a STOP. Either way its stream drops and the
coordinator takes the engine for lost after its delivery timeout, as for an
engine whose sidecar ran inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterable
from typing import Any

from handoff_client import (
    Action,
    Canceled,
    DestinationReserved,
    EngineSidecar,
    Fact,
    Facts,
    Failed,
    HandoffClient,
    OlderIncarnationError,
    Outcome,
    Phase,
    Role,
    SourceHeld,
    TransferCompleted,
)
from handoff_client.errors import NotFoundError
from handoff_vllm import channel as ch
from handoff_vllm.settings import Settings

log = logging.getLogger("handoff.vllm.sidecar")
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0


class EngineCoreError(Exception):
    """A handler raised in the engine core; the message is the engine core's."""


class RemoteEngine:
    """The ``Engine`` the sidecar runs: each handler is a call into the engine core."""

    def __init__(self, channel: ch.Channel) -> None:
        self._channel = channel
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}

    async def _call(self, name: str, action: Action) -> Any:
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._channel.send(ch.CALL, call_id, name, action)
        try:
            # Awaited directly, not through a wrapper: the RESULT wakes this task
            # before the reader starts reporting a fact that followed it, so the
            # SDK queues this handler's outcome first (as in one process).
            return await future
        except asyncio.CancelledError:
            if call_id in self._calls:  # not answered yet: the engine core unwinds it
                unwound: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                self._calls[call_id] = unwound
                self._channel.send(ch.CANCEL, call_id)
                with contextlib.suppress(Exception):
                    await unwound
            raise
        finally:
            self._calls.pop(call_id, None)

    def answered(self, call_id: int, status: str, value: Any) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if status == ch.OK:
            future.set_result(value)
        else:
            future.set_exception(EngineCoreError(str(value)))

    async def submit_prefill(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("submit_prefill", action)

    async def release_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("release_source", action)

    async def cancel_source(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("cancel_source", action)

    async def reserve_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("reserve_destination", action)

    async def start_transfer(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("start_transfer", action)

    async def activate_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("activate_destination", action)

    async def cancel_destination(self, action: Action, facts: Facts) -> Outcome:
        return await self._outcome("cancel_destination", action)

    async def complete(self, action: Action) -> None:
        await self._call("complete", action)

    async def held_handoffs(self) -> Iterable[tuple[str, Role]]:
        held: list[tuple[str, Role]] = await self._call("held_handoffs", None)  # type: ignore[arg-type]
        return held

    async def _outcome(self, name: str, action: Action) -> Outcome:
        outcome = await self._call(name, action)
        assert isinstance(outcome, Outcome), outcome
        return outcome


async def report(facts: Facts, handoff_id: str, fact: Fact) -> None:
    """A fact from the engine core, through the sidecar's own Facts."""
    match fact:
        case SourceHeld(timing):
            await facts.source_held(handoff_id, timing)
        case DestinationReserved(tokens):
            await facts.destination_reserved(handoff_id, tokens)
        case TransferCompleted():
            await facts.transfer_completed(handoff_id)
        case Failed(reason):
            await facts.failed(handoff_id, reason)
        case Canceled(reason):
            await facts.canceled(handoff_id, reason)
        case _:
            raise ValueError(f"the engine core reported {fact!r}: not an engine's fact")


async def gone(client: HandoffClient, handoff_id: str) -> str | None:
    """Why a decode's handoff is gone (unknown or ended), or None while it lives
    or the coordinator does not answer (then the lease decides)."""
    try:
        handoff = await client.get_handoff(handoff_id)
    except NotFoundError:
        return f"handoff {handoff_id} is unknown to the coordinator"
    except Exception as error:
        log.info("GetHandoff %s failed: %s", handoff_id, error)
        return None
    if handoff.phase is Phase.COMPLETE:
        return f"handoff {handoff_id} already ended ({handoff.completion})"
    return None


async def serve(sock: socket.socket) -> None:
    channel = await ch.Channel.open(sock)
    first = await channel.receive()
    if first is None:
        return
    kind, settings = first
    assert kind == ch.SETTINGS, first
    assert isinstance(settings, Settings), first
    remote = RemoteEngine(channel)
    client = HandoffClient(settings.coordinator, **settings.client_options())
    sidecar = EngineSidecar(client, settings.engine_id, remote, stop_grace_s=STOP_GRACE_S)
    tasks: set[asyncio.Task[None]] = set()

    def spawn(work: Any) -> None:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def fact(handoff_id: str, what: Fact) -> None:
        try:
            await report(sidecar.facts, handoff_id, what)
        except Exception as error:
            log.error(
                "%s for handoff %s: report failed: %s", type(what).__name__, handoff_id, error
            )

    async def lookup(lookup_id: int, handoff_id: str) -> None:
        channel.send(ch.ANSWER, lookup_id, await gone(client, handoff_id))

    async def subscribed() -> None:
        try:
            await sidecar.wait_subscribed()
        except OlderIncarnationError as error:
            log.error("engine %s: %s", settings.engine_id, error)
            return
        channel.send(ch.SUBSCRIBED)

    async with client, sidecar:
        log.info(
            "handoff sidecar of engine %s started (coordinator %s, incarnation %s, pid %d)",
            settings.engine_id,
            settings.coordinator,
            sidecar.incarnation,
            os.getpid(),
        )
        channel.send(ch.STARTED, sidecar.incarnation)
        spawn(subscribed())
        while True:
            message = await channel.receive()
            if message is None:
                # The engine core died (a clean stop sends STOP first): die with it,
                # reporting nothing more; the coordinator sees the stream drop.
                log.error("engine %s is gone: its sidecar exits", settings.engine_id)
                os._exit(1)
            kind, *args = message
            if kind == ch.RESULT:
                remote.answered(*args)
            elif kind == ch.FACT:
                spawn(fact(*args))
            elif kind == ch.LOOKUP:
                spawn(lookup(*args))
            elif kind == ch.STOP:
                break
            else:
                log.error("unknown frame %r from the engine core", kind)
    channel.close()


def die_with(parent_pid: int) -> None:
    """Killed by the kernel when the engine core's thread that started us ends."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:
        os._exit(1)  # the engine core died before prctl took
    # A session of its own, so a scheduling group of its own where the kernel
    # groups tasks by session (autogroup): the engine's workers spin on the
    # CPU their group is given, and the heartbeats must not wait behind them.
    with contextlib.suppress(OSError):
        os.setsid()
    # A Ctrl-C or SIGTERM to the engine's process group is the engine's to
    # handle: this process ends when the engine core stops or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(
            "usage: python -m handoff_vllm.sidecar FD PARENT_PID (the connector runs it)"
        )
    die_with(int(argv[2]))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )
    asyncio.run(serve(socket.socket(fileno=int(argv[1]))))


if __name__ == "__main__":
    main(sys.argv)
