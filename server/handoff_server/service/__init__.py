"""The service, on grpc.aio: the RPCs, their guards, and the running server.

- ``convert``: protobuf to domain values (validated) and back.
- ``servicer``: the RPCs: decode, call the registry, answer or refuse; the one
  place a domain error becomes a gRPC status; one writer for both engine
  streams (StreamActions, Connect); Connect's ack window.
- ``guard``: the interceptor: tokens, undecodable input, call and stream limits.
- ``security``: TLS material, bearer tokens and engine identities.
- ``bindings``: which engines a call's caller may act for, from its token and
  certificate; the checks the servicer calls.
- ``quotas``: calls in flight, by kind and per caller.
- ``probes``: grpc.health.v1 on a budget of its own.
- ``exposition``: the ``/metrics`` endpoint on the event loop.
- ``shards``: this process's shard, the refusal of a misrouted start, and the
  shard map it serves.
- ``methods``: each RPC registered with gRPC by name, a queue of its own in
  gRPC's core, so a flood of one RPC delays no other.
- ``app``: the running server: wiring, recovery on start, the timers loop, drain on stop.
"""
