"""The ``handoff`` command: ``cli`` and one module per subcommand.

- ``cli``: the command; its COMMANDS table names each subcommand's module.
- ``serve``, ``health``, ``inspect_cmd``, ``replay``, ``demo``: one subcommand
  each (``demo``: a coordinator process and the SDK's simulator against it,
  crashing the coordinator mid-run).
- ``coordinators``: coordinators as ``handoff serve`` processes, started,
  killed -9 and restarted on their state dir.
- ``conformance``: reading conformance vectors and comparing answers with them.
- ``stubs``: regenerating the committed gRPC stubs from proto/.
"""
