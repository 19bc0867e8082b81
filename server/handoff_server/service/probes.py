"""grpc.health.v1 on a budget of its own, on each port that serves it.

Health answers callers who need no token (probes), so it must never take the
service's call slots, and the service's load must never fail a probe:

- health calls are counted apart from the service's calls (the guard counts
  those against ``max_concurrent_rpcs``), Check and Watch each against their
  own small limit per port, so that watchers cannot crowd out probes;
- a health call whose request has not arrived within ``health_request_within_s``
  is ended: a caller that sends headers and nothing else holds no slot for long.

The statuses themselves live in grpc's :class:`HealthServicer`; this module
only decides who gets to ask.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from handoff_server.service.arrival import first_message
from handoff_server.service.methods import Handler
from handoff_server.service.quotas import Budget, Slot

SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
Context = grpc.aio.ServicerContext[Any, Any]


class HealthGate:
    """The health service of one port: ``health``'s answers behind this port's budgets."""

    def __init__(
        self, health: HealthServicer, *, checks: int, watches: int, request_within_s: float
    ) -> None:
        self.health = health
        self.checks = Budget("health checks", checks, "max_health_checks")
        self.watches = Budget("health watches", watches, "max_health_watches")
        self.request_within_s = request_within_s

    def handlers(self) -> dict[str, Handler]:
        """Check and Watch by name (register them with :func:`methods.register`)."""
        # Both methods are registered as client-streaming, whatever their
        # shape on the wire, so that they start when the call does and can
        # end a call whose request never comes (a unary handler would only
        # start once the request had arrived, holding a slot until then).
        request = health_pb2.HealthCheckRequest.FromString
        response = health_pb2.HealthCheckResponse.SerializeToString
        return {
            "Check": grpc.stream_unary_rpc_method_handler(self._check, request, response),
            "Watch": grpc.stream_stream_rpc_method_handler(self._watch, request, response),
        }

    async def _check(
        self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: Context
    ) -> health_pb2.HealthCheckResponse:
        slot = await self._enter(self.checks, context)
        try:
            request = await self._request(requests, context, slot)
            answer: health_pb2.HealthCheckResponse = await self.health.Check(request, context)
            return answer
        finally:
            slot.leave()

    async def _watch(
        self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: Context
    ) -> None:
        slot = await self._enter(self.watches, context)
        try:
            request = await self._request(requests, context, slot)
            await self.health.Watch(request, context)
        finally:
            slot.leave()

    async def _request(
        self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: Context, slot: Slot
    ) -> health_pb2.HealthCheckRequest:
        return await first_message(
            requests,
            context,
            slot,
            self.request_within_s,
            what="health",
            setting="health_request_within_s",
        )

    @staticmethod
    async def _enter(budget: Budget, context: Context) -> Slot:
        slot = budget.enter()
        if slot is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, budget.refusal())
        return slot
