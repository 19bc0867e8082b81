"""What an operator sets and sees: settings, metrics, traces, logs.

A leaf beside the layers: these import only the vocabulary (``domain.model``;
tracing names Entry and Dispatch in type hints alone), so the registry
reports to them and every layer may use them.

- ``config``: the settings, each a ``handoff serve`` flag and a HANDOFF_* variable.
- ``metrics``: the Prometheus metrics (labels from the vocabulary, bounded).
- ``tracing``: OpenTelemetry spans from the registry's reports (a no-op when off).
- ``logs``: structured log lines (text or JSON) carrying handoff and engine ids.
"""
