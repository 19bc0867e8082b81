"""handoff_vllm: vLLM's KV connector under the handoff coordinator.

``handoff_vllm.connector.HandoffConnector`` is loaded by vLLM from
``--kv-transfer-config`` (docs/integrating.md). Importing this package does
not import vLLM; the connector module does, so it only loads inside vLLM.

- ``settings``: the ``"handoff"`` object of ``kv_connector_extra_config``.
- ``engine``: the sidecar's handlers and the scheduler's hooks, one lock between.
- ``runner``: the engine core's end: spawns the sidecar process, serves its calls.
- ``sidecar``: the sidecar process (``EngineSidecar``, the lease) beside the engine core.
- ``channel``: the local channel between the two.
- ``orders``: what the scheduler tells its worker each step.
- ``connector``: the vLLM connector (NIXL's pull connector, subclassed).
"""
