"""The simulator: engines with finite KV pools, a load generator, faults and a leak check.

:func:`~handoff_client.sim.run.simulate` runs one simulation against a server;
``handoff sim`` and ``handoff demo`` are its commands.
"""
