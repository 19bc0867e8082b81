"""One exception class per gRPC status, so callers catch what they mean.

Every SDK call raises a subclass of :class:`HandoffRpcError`, chained from the
underlying ``grpc.aio.AioRpcError``. The server's message names the handoff
and the reason; it is kept verbatim in :attr:`HandoffRpcError.details`.
"""

from __future__ import annotations

from typing import cast

import grpc


class HandoffRpcError(Exception):
    """A call the server (or the network) refused. ``code`` is the gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str) -> None:
        super().__init__(f"{self.code.name}: {details}")
        self.details = details


class CallCancelledError(HandoffRpcError):
    # Not "CancelledError": that name belongs to asyncio and means something else.
    code = grpc.StatusCode.CANCELLED


class UnknownError(HandoffRpcError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(HandoffRpcError):
    """Malformed or impossible values; the handoff is unchanged."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(HandoffRpcError):
    """The call ran out of time; it may or may not have been applied."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(HandoffRpcError):
    """Unknown handoff (never started, abandoned, or past retention) or action id."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(HandoffRpcError):
    """The handoff id is live or retained."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(HandoffRpcError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(HandoffRpcError):
    """Past an admission limit; back off and try later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(HandoffRpcError):
    """Well-formed, but not allowed in the handoff's current state; it is unchanged."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class OlderIncarnationError(FailedPreconditionError):
    """A newer incarnation of this engine has subscribed: this one was replaced for good.

    The server refused the subscription (``handoff-fence: older-incarnation``);
    it has already declared this incarnation's memory lost. Not retried.
    """


class SessionConflictError(FailedPreconditionError):
    """Another live sidecar holds this engine's stream under the same incarnation.

    The server refused the subscription (``handoff-fence: session-conflict``);
    it lets this one in once the other's stream is gone. Retried with backoff.
    """


class MisroutedError(FailedPreconditionError):
    """A shard refused a StartHandoff for an id another shard owns (``handoff-owner``).

    ``owner`` names that shard. A routing :class:`~handoff_client.HandoffClient`
    refreshes its shard map and sends the start there once; seen by a caller,
    it means the client's shard map and the server's disagree.
    """

    def __init__(self, details: str, owner: str) -> None:
        super().__init__(details)
        self.owner = owner


class AbortedError(HandoffRpcError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(HandoffRpcError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(HandoffRpcError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(HandoffRpcError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(HandoffRpcError):
    """The server is unreachable or shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(HandoffRpcError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(HandoffRpcError):
    """Missing or wrong bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[HandoffRpcError]] = {
    cls.code: cls
    for cls in (
        CallCancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}


_BY_NUMBER: dict[int, type[HandoffRpcError]] = {
    code.value[0]: cls for code, cls in _BY_CODE.items()
}


# Trailing metadata key of a refused subscription, and its values.
FENCE_KEY = "handoff-fence"
_BY_FENCE: dict[str, type[HandoffRpcError]] = {
    "older-incarnation": OlderIncarnationError,
    "session-conflict": SessionConflictError,
}


# Trailing metadata key of a StartHandoff refused by a shard that does not own the id.
OWNER_KEY = "handoff-owner"


# What gRPC's asyncio client reports, instead of the server's status, when
# its write on a stream fails because the server already ended the call
# (grpc/grpc issue 36066): these details, and the failed write named in its
# debug string. The reason the call ended is lost.
_LOST_DETAILS = "Internal error from Core"
_FAILED_WRITE = "SendMessageOperation"


def error_for(error: grpc.aio.AioRpcError) -> HandoffRpcError:
    """The typed exception for ``error``; raise it ``from error`` to keep the chain."""
    cls = _BY_CODE.get(error.code(), UnknownError)
    details = error.details() or ""
    if (
        cls is InternalError
        and details == _LOST_DETAILS
        and _FAILED_WRITE in (error.debug_error_string() or "")
    ):
        return UnavailableError(
            "the server ended the stream while a message was being written to it, and "
            "gRPC's asyncio client lost the server's reason (grpc/grpc issue 36066): "
            "a server that is shutting down, or one older than 0.2.0 refusing the "
            "stream (a token, a scope, its limits); a sidecar reconnects"
        )
    if cls is FailedPreconditionError:
        # The stubs give the sync API's tuple; on grpc.aio it is a Metadata mapping.
        trailers = cast("grpc.aio.Metadata | None", error.trailing_metadata())
        if (owner := _trailer(trailers, OWNER_KEY)) is not None:
            return MisroutedError(details, owner)
        if (fence := _trailer(trailers, FENCE_KEY)) is not None:
            cls = _BY_FENCE.get(fence, cls)
    return cls(details)


def _trailer(trailers: grpc.aio.Metadata | None, key: str) -> str | None:
    value = None if trailers is None else trailers.get(key)
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def error_for_status(code: int, details: str) -> HandoffRpcError:
    """The typed exception for a numeric google.rpc code, as a Connect ack carries it.

    The same class and details the unary call would raise for the same refusal.
    """
    return _BY_NUMBER.get(code, UnknownError)(details)
