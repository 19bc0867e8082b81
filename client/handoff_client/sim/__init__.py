"""The simulator: engines with finite KV pools, a load generator, faults and a leak check.

:func:`~handoff_client.sim.run.simulate` runs one simulation against a server;
``handoff sim`` is its command; ``handoff demo`` (handoff_server.demo) runs it
against a coordinator in the same process.
"""
