"""Each RPC registered with gRPC by its name, so each has a queue of its own.

gRPC's core holds the calls that have arrived and that the Python server has
not taken yet in one queue per registered method, and the Python server takes
each queue's calls one at a time. The committed stubs register a generic
handler only (they come from the generator whose code still imports on the
SDK's oldest grpcio), and behind generic handlers every method shares one
queue: a peer that keeps one method's calls queued (HTTP/2 rapid reset needs
no token) would delay every caller's calls of every method, health checks on
the service port included. Registered, it delays only the method it floods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from handoff_proto.v1 import coordinator_pb2 as pb

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

# How the generated stubs wrap a method, by (client streaming, server streaming).
_SHAPES: dict[tuple[bool, bool], Callable[..., Handler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}

COORDINATOR: ServiceDescriptor = pb.DESCRIPTOR.services_by_name["HandoffCoordinator"]


def coordinator_handlers(servicer: object) -> dict[str, Handler]:
    """The servicer's method for each RPC of the coordinator's service, by
    name, wrapped as the generated stubs wrap it."""
    handlers = {}
    for method in COORDINATOR.methods:
        request: type[Message] = getattr(pb, method.input_type.name)
        response: type[Message] = getattr(pb, method.output_type.name)
        shape = _SHAPES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = shape(
            getattr(servicer, method.name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return handlers


def register(server: grpc.aio.Server, service: str, handlers: Mapping[str, Handler]) -> None:
    """``handlers`` (by method name) as ``service``'s registered methods on ``server``."""
    add: Callable[[str, Mapping[str, Any]], None] = server.add_registered_method_handlers  # type: ignore[attr-defined]
    add(service, handlers)
