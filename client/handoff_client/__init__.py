"""handoff_client: the SDK for frontends and engine sidecars.

- :class:`HandoffClient`: typed async calls (start, report, get, stream).
- :class:`EngineSidecar`: runs an :class:`Engine`'s handlers for its actions
  (or a :class:`SourceEngine`'s or :class:`DestinationEngine`'s: one side),
  over :class:`ConnectTransport` (one stream per engine) or
  :class:`UnaryTransport`. docs/engine-contract.md says what handlers must do.
- Ready-made outcomes for handlers: ``SUBMITTED``, ``ACCEPTED``, ``SCHEDULED``,
  ``APPLIED``, ``NOOP``, ``failed(reason)``.
- :mod:`handoff_client.errors`: one exception per gRPC status.
- :mod:`handoff_client.sim`: simulated engines and load, behind ``handoff sim``
  and ``handoff demo``.

Which module owns what:

- ``client``: :class:`HandoffClient`, one typed call per RPC.
- ``routing``: which shard each of its calls goes to (the shard map, the
  owners it remembers); ``placement``: rendezvous placement of new ids and
  :class:`ShardMap`, shared with the server.
- ``sidecar``: :class:`EngineSidecar`: actions in, handlers run, reports out.
- ``transport``: the seam between sidecar and coordinator, and the unary
  transport; ``connect``: the Connect transport (one stream per engine).
- ``link``: one coordinator's subscription, reconcile and lease;
  ``liveness``: what a transport last heard from it.
- ``outbox``: one handoff's reports, landing in the order made.
- ``cache``: what each action came to, so a redelivered one is answered again.
- ``ledger``: per handoff side, what the engine did (tombstones against
  late or reordered actions).
- ``model``: the SDK's values; ``convert``: those values to and from the wire.
- ``errors``: one exception per gRPC status; ``retry``: backoff with jitter.
- ``credentials``: TLS material and the bearer token for a channel.
"""

from handoff_client.client import HandoffClient
from handoff_client.connect import ConnectTransport
from handoff_client.errors import (
    HandoffRpcError,
    MisroutedError,
    OlderIncarnationError,
    SessionConflictError,
)
from handoff_client.model import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionKind,
    Canceled,
    Completion,
    DestinationReserved,
    EndCause,
    EndReason,
    EngineLost,
    EngineType,
    Fact,
    Failed,
    Handoff,
    HandoffUpdate,
    LifecycleEvent,
    LifecycleEventKind,
    LostCause,
    Order,
    Origin,
    Outcome,
    OutcomeKind,
    Phase,
    Role,
    SourceHeld,
    TimedOut,
    TimingMode,
    TransferCompleted,
    TransferTiming,
    failed,
)
from handoff_client.placement import ShardInfo, ShardMap
from handoff_client.retry import Backoff, RetryPolicy
from handoff_client.sidecar import (
    DestinationEngine,
    Engine,
    EngineSidecar,
    Facts,
    SidecarStats,
    SourceEngine,
    new_incarnation,
)
from handoff_client.transport import SidecarTransport, TransportKind, UnaryTransport

__all__ = [
    "ACCEPTED",
    "APPLIED",
    "NOOP",
    "SCHEDULED",
    "SUBMITTED",
    "Action",
    "ActionKind",
    "Backoff",
    "Canceled",
    "Completion",
    "ConnectTransport",
    "DestinationEngine",
    "DestinationReserved",
    "EndCause",
    "EndReason",
    "Engine",
    "EngineLost",
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
    "LostCause",
    "MisroutedError",
    "OlderIncarnationError",
    "Order",
    "Origin",
    "Outcome",
    "OutcomeKind",
    "Phase",
    "RetryPolicy",
    "Role",
    "SessionConflictError",
    "ShardInfo",
    "ShardMap",
    "SidecarStats",
    "SidecarTransport",
    "SourceEngine",
    "SourceHeld",
    "TimedOut",
    "TimingMode",
    "TransferCompleted",
    "TransferTiming",
    "TransportKind",
    "UnaryTransport",
    "failed",
    "new_incarnation",
]
