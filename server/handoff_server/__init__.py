"""handoff: a coordinator for prefill-to-decode KV-cache handoffs.

Four layers, each a package, each importing only the ones before it:

- ``domain``: the handoff's vocabulary, state machine and table; synchronous
  and clock-injected, no I/O (``ops`` is the one thing it reports to).
- ``durability``: the journal on SQLite, its record format, and recovery.
- ``service``: the gRPC service on grpc.aio, its guards and its wiring.
- ``commands``: the ``handoff`` command and its subcommands.

``ops`` (settings, metrics, traces, logs) is a leaf beside them: it reads only
the vocabulary (``domain.model``), and every layer may use it.

Where each behaviour lives, one hop each:

- a handoff's rules: ``domain.core``; its words: ``domain.model``;
- an engine stream that drops: ``domain.delivery`` (``Delivery.unsubscribe``
  arms the delivery timeout; ``Registry._lose`` reports EngineLost when it
  fires); the streams themselves: ``service.servicer`` (``Servicer._write``);
- crash recovery: ``durability.recovery`` (``recover``), records in
  ``durability.records``, the fast path in ``durability.rebuild``;
- who may report what: ``domain.authorization``; who the caller is:
  ``service.security``;
- a misrouted start (another shard owns the id): ``service.shards``
  (``Shards.check_start``), answered by ``service.servicer``.
"""
