"""handoff_client: the SDK for frontends and engine sidecars.

- :class:`HandoffClient`: typed async calls (start, report, get, stream).
- :class:`EngineSidecar`: runs an :class:`Engine`'s handlers for its actions,
  over :class:`ConnectTransport` (one stream per engine) or
  :class:`UnaryTransport`.
- :mod:`handoff_client.errors`: one exception per gRPC status.
- :mod:`handoff_client.sim`: simulated engines and load, behind ``handoff sim``
  and ``handoff demo``.
"""

from handoff_client.client import HandoffClient
from handoff_client.connect import ConnectTransport
from handoff_client.errors import HandoffRpcError
from handoff_client.model import (
    Action,
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EngineType,
    Fact,
    Failed,
    Handoff,
    HandoffUpdate,
    LifecycleEvent,
    LifecycleEventKind,
    Order,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
)
from handoff_client.retry import Backoff, RetryPolicy
from handoff_client.sidecar import Engine, EngineSidecar, Facts, SidecarStats
from handoff_client.transport import SidecarTransport, TransportKind, UnaryTransport

__all__ = [
    "Action",
    "ActionKind",
    "Backoff",
    "Canceled",
    "Completion",
    "ConnectTransport",
    "DestinationReserved",
    "Engine",
    "EngineSidecar",
    "EngineType",
    "Fact",
    "Facts",
    "Failed",
    "Handoff",
    "HandoffClient",
    "HandoffRpcError",
    "HandoffUpdate",
    "LifecycleEvent",
    "LifecycleEventKind",
    "Order",
    "Outcome",
    "OutcomeKind",
    "Phase",
    "RetryPolicy",
    "Role",
    "SidecarStats",
    "SidecarTransport",
    "SourceHeld",
    "TimedOut",
    "TimingMode",
    "TransferCompleted",
    "TransferTiming",
    "TransportKind",
    "UnaryTransport",
]
