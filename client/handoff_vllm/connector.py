"""HandoffConnector: vLLM's NIXL connector with each handoff under the coordinator.

Load it with ``--kv-transfer-config`` (docs/integrating.md):
``{"kv_connector": "HandoffConnector", "kv_connector_module_path":
"handoff_vllm.connector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
"kv_connector_extra_config": {"handoff": {"coordinator": "HOST:PORT",
"engine_id": "prefill-0"}}}``.

It is NIXL's pull connector (a subclass: every transfer, handshake and metric
is NIXL's own), with four changes for requests that carry
``kv_transfer_params["handoff_id"]``:

- prefill: the held blocks' NIXL expiry is suppressed once SubmitPrefill came
  (the coordinator is in charge); ReleaseSource/CancelSource free them at the
  worker's next step, a source the sidecar frees on its own goes back to
  NIXL's lease; a prefill canceled while it runs is freed at its end;
- decode: NIXL's read is issued only at StartTransfer, and the finished read
  is kept from the scheduler until ActivateDestination: the decode is never
  scheduled on KV the coordinator has not vouched for; a handoff that ended
  fails the load (``failed_recving``) instead of decoding;
- the facts come from vLLM's own callbacks (SourceHeld at ``request_finished``,
  DestinationReserved at ``update_state_after_alloc``, TransferCompleted at the
  finished receive);
- the scheduler-side connector runs the sidecar in a process beside the engine
  core (runner.py, sidecar.py, over channel.py); its orders to
  the worker ride on the step's connector metadata (orders.py).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from vllm import __version__ as vllm_version
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.outputs import KVConnectorOutput

from handoff_vllm import settings as settings_module
from handoff_vllm.engine import HandoffEngine
from handoff_vllm.orders import ATTRIBUTE, WorkerOrders
from handoff_vllm.pacing import pace_progress_thread
from handoff_vllm.runner import SidecarProcess

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("handoff.vllm")

# The vLLM release this connector was written and tested against: it reaches
# into NIXL's worker (its map of held requests to their expiry) and relies on
# the scheduler's order of hooks, which move between releases.
TESTED_VLLM = "0.32.0"
HANDOFF_ID = "handoff_id"


def check_version(version: str, allow_other: bool) -> None:
    if version == TESTED_VLLM:
        return
    message = (
        f"HandoffConnector was written against vLLM {TESTED_VLLM} and this is vLLM "
        f"{version}: NIXL's internals it relies on may differ"
    )
    if not allow_other:
        raise RuntimeError(
            message + '; set kv_connector_extra_config["handoff"]["allow_other_vllm"] = true '
            "to run anyway, after running make test-vllm on this version"
        )
    log.warning(message)


def log_like_vllm() -> None:
    """The SDK's and the connector's logs ("handoff.*") go where vLLM's go."""
    ours, theirs = logging.getLogger("handoff"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class HandoffConnector(NixlPullConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = transfer.kv_connector_extra_config
        settings = settings_module.parse(extra, extra.get("kv_lease_duration"))
        check_version(vllm_version, settings.allow_other_vllm)
        # NIXL's lease outlasts the coordinator's deadline: it frees a held source
        # only when the coordinator could not (see Settings.kv_lease_s).
        extra.setdefault("kv_lease_duration", settings.kv_lease_s)
        if role == KVConnectorRole.WORKER:  # the worker makes the NIXL agent
            pace_progress_thread(settings.nixl_progress_delay_us)
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = settings
        self._engine: HandoffEngine | None = None
        self._sidecar: SidecarProcess | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._engine = HandoffEngine(
                settings.engine_id, kv_bytes_per_token(kv_cache_config), settings.bandwidth_gb_s
            )
            self._sidecar = SidecarProcess(settings, self._engine)
            self._sidecar.start()
        elif role == KVConnectorRole.WORKER:
            worker = self.connector_worker
            if worker is None or not isinstance(getattr(worker, "_reqs_to_send", None), dict):
                raise RuntimeError(
                    f"HandoffConnector: NIXL's worker in vLLM {vllm_version} has no _reqs_to_send "
                    "map; this vLLM is not one the connector supports"
                )
            self._lease_s = float(extra["kv_lease_duration"])
            # Requests ordered freed, until NIXL has: a decode's heartbeat can
            # push the expiry out again between our order and NIXL's reaping.
            self._freeing: set[str] = set()

    # --- scheduler side -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        handoff_id = _handoff_id(request)
        if handoff_id is not None and self._engine is not None:
            params = request.kv_transfer_params
            if params.get("do_remote_decode"):
                self._engine.on_prefill_seen(handoff_id, request.request_id)
            elif params.get("do_remote_prefill"):
                self._engine.on_decode_seen(handoff_id, request.request_id)
        return answer

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        handoff_id = _handoff_id(request)
        params = request.kv_transfer_params
        if (
            handoff_id is None
            or self._engine is None
            or not params.get("do_remote_prefill")
            or not params.get("remote_block_ids")
        ):
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        # The read waits for StartTransfer (reads_to_issue, at a later step).
        if self._engine.on_decode_allocated(handoff_id, request, blocks, num_external_tokens):
            super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        engine = self._engine
        if engine is not None:
            for request, blocks, external in engine.reads_to_issue():
                super().update_state_after_alloc(request, blocks, external)
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, NixlConnectorMetadata)
        if engine is not None:
            setattr(meta, ATTRIBUTE, engine.take_orders())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        engine = self._engine
        if engine is None:
            return
        if connector_output.finished_sending:
            engine.on_sent(connector_output.finished_sending)
        received = connector_output.finished_recving
        if received:
            failures = connector_output.failed_recving or set()
            kept = {r for r in received if engine.on_recv_finished(r, r in failures)}
            # Kept from the scheduler until ActivateDestination, or until the
            # worker reports the load failed (WorkerOrders).
            received.difference_update(kept)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(
            request, lambda: super(HandoffConnector, self).request_finished(request, block_ids)
        )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(
            request,
            lambda: super(HandoffConnector, self).request_finished_all_groups(request, block_ids),
        )

    def _finished(self, request: Request, finish: Any) -> tuple[bool, dict[str, Any] | None]:
        handoff_id = _handoff_id(request)
        engine = self._engine
        if handoff_id is None or engine is None:
            return finish()  # type: ignore[no-any-return]
        params = request.kv_transfer_params
        if params.get("do_remote_decode"):
            delay, out = finish()
            held = request.num_computed_tokens if delay else None
            engine.on_prefill_finished(handoff_id, request.request_id, held, str(request.status))
            if out is not None:
                out[HANDOFF_ID] = handoff_id
            return delay, out
        if engine.on_decode_finished(handoff_id, request.request_id):
            # NIXL never read for it: it must not notify the prefill (a read of
            # nothing); the coordinator frees the prefill.
            params["do_remote_prefill"] = False
        return finish()  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        if self._sidecar is not None:
            self._sidecar.stop()
        super().shutdown()

    # --- worker side --------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        orders = getattr(self._connector_metadata, ATTRIBUTE, None)
        if isinstance(orders, WorkerOrders):
            self._apply(orders)

    def _apply(self, orders: WorkerOrders) -> None:
        """Held requests' NIXL expiry, after NIXL registered this step's new ones."""
        worker = self.connector_worker
        assert worker is not None
        expiry: dict[str, float] = worker._reqs_to_send
        now = time.perf_counter()
        for request_id in orders.hold:
            if request_id in expiry:
                expiry[request_id] = math.inf
        for request_id in orders.hand_back:
            if request_id in expiry:
                expiry[request_id] = now + self._lease_s
        self._freeing.update(orders.free)
        self._expire_freeing()

    def _expire_freeing(self) -> None:
        """NIXL's own reaping frees these at this step's get_transfer_results."""
        assert self.connector_worker is not None
        expiry: dict[str, float] = self.connector_worker._reqs_to_send
        now = time.perf_counter()
        for request_id in list(self._freeing):
            if request_id in expiry:
                expiry[request_id] = now
            else:
                self._freeing.discard(request_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._freeing:
            self._expire_freeing()
        results = super().get_transfer_results(finished_req_ids)
        orders = getattr(self._connector_metadata, ATTRIBUTE, None)
        if isinstance(orders, WorkerOrders) and (orders.fail_recv or orders.release_recv):
            results.finished_recving.update(orders.fail_recv, orders.release_recv)
            results.failed_recving.update(orders.fail_recv)
        return results


def _handoff_id(request: Request) -> str | None:
    params = request.kv_transfer_params
    if not params:
        return None
    value = params.get(HANDOFF_ID)
    return value if isinstance(value, str) and value else None


def kv_bytes_per_token(kv_cache_config: KVCacheConfig) -> int | None:
    """The KV one token takes across all layers, as NIXL moves it."""
    try:
        total = 0.0
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            total += spec.page_size_bytes * len(group.layer_names) / spec.block_size
        return int(total) or None
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
