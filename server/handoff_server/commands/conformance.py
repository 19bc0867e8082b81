"""Conformance vectors: parse them, and compare what an implementation answered.

The format is described in ``tests/conformance/README.md``. This module knows
nothing about how a step is executed: the core runner below calls the state
machine directly, the service tests drive a running server over gRPC, and both
compare with :func:`mismatch`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handoff_server.domain.core import Handoff
from handoff_server.domain.model import (
    Action,
    ActionKind,
    Canceled,
    DestinationReserved,
    EngineLost,
    Fact,
    Failed,
    HandoffError,
    Order,
    Outcome,
    OutcomeKind,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)

DELAY_RELATIVE_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Answer:
    """What a call answered: the expected one from a vector, or an observed one."""

    ok: bool
    code: str | None
    actions: tuple[Action, ...]
    phase: str | None
    completion: str | None
    message: str = ""


@dataclass(frozen=True, slots=True)
class StartStep:
    handoff_id: str
    order: Order
    fallback_transfer_delay_ms: float
    expect: Answer


@dataclass(frozen=True, slots=True)
class FactStep:
    fact: Fact
    expect: Answer


@dataclass(frozen=True, slots=True)
class OutcomeStep:
    action_id: int
    outcome: Outcome
    expect: Answer


Step = StartStep | FactStep | OutcomeStep


@dataclass(frozen=True, slots=True)
class Vector:
    name: str
    steps: tuple[Step, ...]

    @property
    def handoff_id(self) -> str:
        first = self.steps[0]
        assert isinstance(first, StartStep), f"{self.name}: the first step must be a start"
        return first.handoff_id


def _float(value: Any) -> float:
    # Non-finite floats travel as the strings of the protobuf JSON convention.
    return float(value) if not isinstance(value, str) else float(value.replace("Infinity", "inf"))


def _optional_float(value: Any) -> float | None:
    return None if value is None else _float(value)


def parse_fact(raw: dict[str, Any]) -> Fact:
    kind = raw["kind"]
    if kind == "source_held":
        timing = raw["transfer_timing"]
        kv_bytes = timing.get("kv_bytes_per_token")
        return SourceHeld(
            TransferTiming(
                mode=TimingMode(timing["mode"]),
                full_prompt_tokens=int(timing["full_prompt_tokens"]),
                kv_bytes_per_token=None if kv_bytes is None else int(kv_bytes),
                bandwidth_gb_s=_optional_float(timing.get("bandwidth_gb_s")),
                state_bytes=int(timing.get("state_bytes", 0)),
            )
        )
    if kind == "destination_reserved":
        return DestinationReserved(int(raw["transferable_prompt_tokens"]))
    if kind == "engine_lost":
        return EngineLost(Role(raw["role"]))
    simple: dict[str, Fact] = {
        "transfer_completed": TransferCompleted(),
        "failed": Failed(),
        "timed_out": TimedOut(),
        "canceled": Canceled(),
    }
    return simple[kind]


def _parse_answer(raw: dict[str, Any]) -> Answer:
    return Answer(
        ok=bool(raw["ok"]),
        code=raw.get("code"),
        actions=tuple(
            Action(
                int(a["id"]),
                ActionKind(a["kind"]),
                _optional_float(a.get("delay_ms")),
            )
            for a in raw.get("actions", ())
        ),
        phase=raw.get("phase"),
        completion=raw.get("completion"),
        message=raw.get("message", ""),
    )


def parse_step(raw: dict[str, Any]) -> Step:
    expect = _parse_answer(raw["expect"])
    op = raw["op"]
    if op == "start":
        return StartStep(
            raw["handoff_id"],
            Order(raw["order"]),
            _float(raw["fallback_transfer_delay_ms"]),
            expect,
        )
    if op == "fact":
        return FactStep(parse_fact(raw["fact"]), expect)
    if op == "outcome":
        outcome = raw["outcome"]
        return OutcomeStep(
            int(raw["action_id"]),
            Outcome(OutcomeKind(outcome["kind"]), outcome.get("reason", "")),
            expect,
        )
    raise ValueError(f"unknown op {op!r}")


def load_vectors(path: Path) -> Iterator[Vector]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                yield Vector(raw["name"], tuple(parse_step(s) for s in raw["steps"]))
            except (KeyError, ValueError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a conformance vector: {error}") from error


def _describe_actions(actions: tuple[Action, ...]) -> str:
    parts = []
    for action in actions:
        delay = "" if action.delay_ms is None else f"(delay_ms={action.delay_ms!r})"
        parts.append(f"{action.id}:{action.kind.value}{delay}")
    return "[" + ", ".join(parts) + "]"


def _same_delay(expected: float | None, observed: float | None) -> bool:
    if expected is None or observed is None:
        return expected is observed
    return math.isclose(expected, observed, rel_tol=DELAY_RELATIVE_TOLERANCE, abs_tol=0.0)


def mismatch(expected: Answer, observed: Answer) -> str | None:
    """Why ``observed`` fails ``expected``, or None when it conforms."""
    if expected.ok != observed.ok or (not expected.ok and expected.code != observed.code):
        want = "ok" if expected.ok else expected.code
        got = "ok" if observed.ok else f"{observed.code} ({observed.message})"
        return f"expected {want}, got {got}"
    same_actions = len(expected.actions) == len(observed.actions) and all(
        e.id == o.id and e.kind == o.kind and _same_delay(e.delay_ms, o.delay_ms)
        for e, o in zip(expected.actions, observed.actions, strict=True)
    )
    if not same_actions:
        return (
            f"expected actions {_describe_actions(expected.actions)}, "
            f"got {_describe_actions(observed.actions)}"
        )
    if (expected.phase, expected.completion) != (observed.phase, observed.completion):
        return (
            f"expected phase={expected.phase} completion={expected.completion}, "
            f"got phase={observed.phase} completion={observed.completion}"
        )
    return None


@dataclass(frozen=True, slots=True)
class Failure:
    vector: str
    step: int
    op: str
    reason: str

    def __str__(self) -> str:
        return f"{self.vector} step {self.step} ({self.op}): {self.reason}"


def step_op(step: Step) -> str:
    if isinstance(step, StartStep):
        return "start"
    return "fact" if isinstance(step, FactStep) else "outcome"


def run_on_core(vector: Vector) -> Failure | None:
    """Replay one vector through the pure core; the first mismatching step, if any."""
    handoff: Handoff | None = None
    for index, step in enumerate(vector.steps):
        actions: tuple[Action, ...] = ()
        error: HandoffError | None = None
        try:
            if isinstance(step, StartStep):
                handoff = Handoff(step.handoff_id, step.order, step.fallback_transfer_delay_ms)
                actions = handoff.start()
            elif handoff is None:
                raise ValueError("a fact or outcome before the handoff was started")
            elif isinstance(step, FactStep):
                actions = handoff.apply_fact(step.fact)
            else:
                actions = handoff.apply_outcome(step.action_id, step.outcome)
        except HandoffError as rejected:
            error = rejected
        observed = Answer(
            ok=error is None,
            code=None if error is None else error.code,
            actions=actions,
            phase=None if handoff is None else handoff.phase.value,
            completion=None
            if handoff is None or handoff.completion is None
            else handoff.completion.value,
            message="" if error is None else error.message,
        )
        reason = mismatch(step.expect, observed)
        if reason is not None:
            return Failure(vector.name, index, step_op(step), reason)
    return None
