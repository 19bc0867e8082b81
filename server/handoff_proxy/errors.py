"""What went wrong with a request, as an HTTP status and an OpenAI-style error body.

Every error names the leg (``start``: the coordinator's StartHandoff;
``prefill``; ``decode``), the engine and the handoff when there is one, so
that the client's message is enough to find the handoff (``handoff inspect``)
and the engine's log. 502: an engine failed or the coordinator canceled the
handoff; 503: no engine free, or no coordinator; 504: the handoff's deadline
passed.
"""

from __future__ import annotations

from typing import Any

# The error body's "type", by status, as OpenAI's API and vLLM spell them.
ERROR_TYPES = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


class ProxyError(Exception):
    """A request the proxy answers with ``status`` and ``message``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        leg: str | None = None,
        engine_id: str | None = None,
        handoff_id: str | None = None,
        why: str = "engine_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.leg = leg
        self.engine_id = engine_id
        self.handoff_id = handoff_id
        self.why = why  # a bounded metrics label: engine_error, canceled, deadline, ...

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": ERROR_TYPES.get(self.status, "server_error"),
            "param": None,
            "code": self.status,
        }
        for name in ("leg", "engine_id", "handoff_id"):
            value = getattr(self, name)
            if value is not None:
                error[name] = value
        return {"error": error}
