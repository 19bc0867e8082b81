"""The simulator: engines with finite KV pools, a load generator, faults and a leak check.

:func:`~handoff_client.sim.run.simulate` runs one simulation against a server;
``handoff sim`` is its command; ``handoff demo`` (handoff_server.commands.demo) runs it
against a coordinator process of its own, which it can crash and restart.

Which module owns what:

- ``run``: one simulation, start to end: fleet up, load, faults, settle,
  leak check, fleet down.
- ``config``: what a simulation runs (engines, load, faults), as frozen values.
- ``options``: the command-line flags ``sim`` and ``demo`` share, and the config they make.
- ``cli``: ``handoff sim``, against a running coordinator.
- ``cluster``: the fleet: per stack, prefill and decode engines, each behind a sidecar.
- ``engine``: one simulated prefill or decode engine; ``pool``: its finite KV blocks.
- ``frontend``: the load generator, playing the router that starts and cancels
  handoffs; ``workload``: the requests it sends.
- ``faults``: connection faults injected between a sidecar and its transport,
  and the coordinator crashes the demo injects.
- ``leaks``: the end-of-run check that every pool is full again and every handoff finished.
- ``report``, ``progress`` and ``scrape``: the summary, the live progress line,
  and the server's own counters read from its metrics endpoint.
"""
