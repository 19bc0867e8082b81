"""Requests the frontend sends: sizes, stack, and how each one's transfer is timed.

In a real deployment the frontend hands the prompt to both engines out of
band; the coordinator only coordinates. The :class:`RequestBook` plays that
part: engines look up the request a handoff carries.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from handoff_client.model import EngineType, Role, TimingMode, TransferTiming
from handoff_client.sim.config import EngineProfile, LoadProfile

MIN_OUTPUT_TOKENS = 16
PROMPT_SIGMA = 0.8  # spread of the log-normal prompt lengths


@dataclass(frozen=True, slots=True)
class Request:
    stack: EngineType
    prompt_tokens: int
    output_tokens: int
    cached_prefix_tokens: int  # already on the decode engine (prefix cache)
    timing: TransferTiming
    transfer_executor: Role

    @property
    def transferable_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prefix_tokens


class RequestBook:
    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}

    def add(self, handoff_id: str, request: Request) -> None:
        self._requests[handoff_id] = request

    def get(self, handoff_id: str) -> Request:
        return self._requests[handoff_id]


def draw_request(
    stack: EngineType, load: LoadProfile, engine: EngineProfile, rng: random.Random
) -> Request:
    """One request, with the transfer conventions of its stack.

    vLLM: the decode engine pulls the full prompt's KV. SGLang: the prefill
    engine pushes only what the decode's prefix cache lacks. TensorRT-LLM:
    the engine does not know its link bandwidth, so the coordinator falls
    back to the handoff's fixed delay. Together they cover every delay path.
    """
    prompt = math.exp(rng.gauss(math.log(load.prompt_median_tokens), PROMPT_SIGMA))
    prompt_tokens = max(1, min(load.prompt_max_tokens, round(prompt)))
    output_tokens = rng.randint(MIN_OUTPUT_TOKENS, max(MIN_OUTPUT_TOKENS, load.output_max_tokens))
    cached = 0
    if stack is EngineType.SGLANG:
        cached = rng.randint(0, prompt_tokens // 2)
        timing = TransferTiming(
            TimingMode.DESTINATION_MISSING,
            prompt_tokens,
            engine.kv_bytes_per_token,
            engine.bandwidth_gb_s,
        )
    elif stack is EngineType.VLLM:
        timing = TransferTiming(
            TimingMode.FULL_PROMPT, prompt_tokens, engine.kv_bytes_per_token, engine.bandwidth_gb_s
        )
    else:
        timing = TransferTiming(TimingMode.FULL_PROMPT, prompt_tokens, engine.kv_bytes_per_token)
    executor = Role.DESTINATION if stack is EngineType.VLLM else Role.SOURCE
    return Request(stack, prompt_tokens, output_tokens, cached, timing, executor)
