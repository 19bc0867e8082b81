"""handoff: a coordinator for prefill-to-decode KV-cache handoffs.

Which module owns what, from the pure core outwards (layers point inwards):

The domain, synchronous and clock-injected (no awaits, so each call is atomic;
``core`` is also pure: no I/O, no clock):

- ``model``: the vocabulary: orders, facts, actions, outcomes, domain errors.
- ``core``: the state machine of one handoff; every transition is there.
- ``packing``: a completed handoff packed into a few words for retention.
- ``entries``: what the registry keeps per handoff (a full Entry, a Retained one).
- ``retention``: finished handoffs kept for a while, expired and evicted oldest first.
- ``timers``: the timer heap and the kinds of timer the server sets.
- ``delivery``: an issued action until its engine acknowledges it: queues,
  redelivery, streams, incarnations and fencing.
- ``registry``: the handoff table and the one path every call takes; what
  each timer does when it fires.

The service, on grpc.aio:

- ``convert``: protobuf to domain values (validated) and back.
- ``servicer``: the RPCs: decode, call the registry, answer or refuse; the
  one place a domain error becomes a gRPC status; Connect's ack window.
- ``guard``: the interceptor: tokens, undecodable input, call and stream limits.
- ``security``: TLS material, bearer tokens and engine identities, and the
  checks that use them.
- ``quotas``: calls in flight, by kind and per caller.
- ``probes``: grpc.health.v1 on a budget of its own.
- ``metrics`` and ``exposition``: the Prometheus metrics and their endpoint.
- ``logs``: structured log lines (text or JSON) carrying handoff and engine ids.
- ``journal``: accepted calls kept in SQLite, and the durability barrier the
  servicer awaits before it writes; ``recovery``: what a journal record means,
  and replaying a journal into a registry on start; ``rebuild``: an unfinished
  handoff rebuilt from its records through the core alone, for recovery.
- ``config``: the settings, each a flag and a HANDOFF_* variable.
- ``shards``: this process's shard (name, ordinal, the placing shards), the
  refusal of a start another shard owns, and the shard map it serves.
- ``app``: the running server: wiring, timers loop, drain on stop.

Commands (``handoff ...``):

- ``cli``: the command and its subcommands; ``serve``, ``health``,
  ``inspect_cmd``, ``replay`` and ``demo`` (a coordinator process and the
  SDK's simulator against it, crashing the coordinator mid-run) are one
  subcommand each; ``coordinators``: coordinators as ``handoff serve``
  processes, started, killed -9 and restarted on their state dir;
  ``coordinator_options``: the TLS and token flags of the commands that call
  a coordinator (``inspect``, and ``proxy`` in handoff_proxy).
- ``conformance``: reading conformance vectors and comparing answers with them.
- ``stubs``: regenerating the committed gRPC stubs from proto/.
"""
