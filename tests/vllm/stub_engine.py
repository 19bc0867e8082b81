"""An engine core without vLLM: the connector's HandoffEngine and SidecarProcess.

``python -m tests.vllm.stub_engine COORDINATOR ENGINE_ID`` prints its sidecar
process's pid, then takes the scheduler's hooks from stdin, one per line:
``held HANDOFF_ID`` (a prefill request finished holding 64 tokens, as
vLLM's ``request_finished`` reports it). Its "scheduler" steps every 10 ms
and its "worker" frees at once what it is ordered to free. Used by test_sidecar_process.py to
drive the channel and kill -9 the "engine" in a few seconds, not minutes.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from handoff_vllm.engine import HandoffEngine
from handoff_vllm.runner import SidecarProcess
from handoff_vllm.settings import Settings


def main(coordinator: str, engine_id: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    engine = HandoffEngine(engine_id, 1024, None)
    sidecar = SidecarProcess(Settings(coordinator=coordinator, engine_id=engine_id), engine)
    sidecar.start()
    threading.Thread(target=steps, args=(engine,), daemon=True).start()
    assert sidecar.process is not None
    print(sidecar.process.pid, flush=True)
    for line in sys.stdin:
        verb, handoff_id = line.split()
        if verb == "held":
            request_id = f"cmpl-{handoff_id}"
            engine.on_prefill_seen(handoff_id, request_id)
            engine.on_prefill_finished(handoff_id, request_id, 64, "FINISHED_LENGTH_CAPPED")
    sidecar.stop()


def steps(engine: HandoffEngine) -> None:
    """vLLM's loop, in short: take the step's orders; the worker frees what they free."""
    while True:
        orders = engine.take_orders()
        if orders.free:
            engine.on_sent(orders.free)
        time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
