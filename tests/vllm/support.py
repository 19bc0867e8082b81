"""Real processes for the vLLM tests, bench/vllm.py and make demo-vllm.

A coordinator (``handoff serve`` from the main venv, HANDOFF_COORDINATOR),
vLLM OpenAI servers with the HandoffConnector (or plain NIXL), and the two
P/D legs a frontend sends. Nothing here sleeps to let something happen: each
wait polls a condition (a port, /health, /metrics, GetHandoff) until a
deadline and then fails naming what it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from handoff_client import Completion, EngineType, Handoff, HandoffClient, Phase, Role
from tests.support.fakes import free_port

ROOT = Path(__file__).resolve().parents[2]
# Cold, two engines at once on a shared 2-core machine: minutes, not seconds.
ENGINE_START_S = 600.0
POLL_S = 0.05
MAX_MODEL_LEN = 256
BLOCK_SIZE = 32


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` of a log, for a failure's message."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def coordinator_command() -> list[str]:
    command = os.environ.get("HANDOFF_COORDINATOR")
    if command:
        return [command]
    main = ROOT / ".venv" / "bin" / "handoff"
    if main.exists():
        return [str(main)]
    return [sys.executable, "-m", "handoff_server.commands.cli"]


async def poll(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    """Until ``check()`` is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(POLL_S)


@dataclass
class Coordinator:
    """``handoff serve --state-dir``; restartable on the same directory and port."""

    directory: Path
    delivery_timeout_s: float = 10.0
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "coordinator.log").open("ab")
        self.process = subprocess.Popen(
            [
                *coordinator_command(),
                "serve",
                "--host=127.0.0.1",
                f"--port={self.port}",
                "--metrics-port=-1",
                "--health-port=-1",
                f"--state-dir={self.directory / 'state'}",
                f"--delivery-timeout-s={self.delivery_timeout_s}",
                # A stopped engine's stream ends within 10 s, not keepalive's 30 s
                # by default: the SIGSTOP test waits for it.
                "--keepalive-time-s=5",
                "--keepalive-timeout-s=5",
                "--drain-grace-s=0.1",
                "--log-level=info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    async def ready(self) -> None:
        async def listening() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"coordinator exited: {self.log_tail()}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                return False
            writer.close()
            return True

        await poll(f"coordinator on {self.address}", listening, 30.0)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.directory / "coordinator.log", lines)

    def connections(self, engine_id: str) -> int:
        """How often ``engine_id`` has subscribed, by the coordinator's log."""
        path = self.directory / "coordinator.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text.count(f"engine connected [engine_id={engine_id}]")


def kv_transfer_config(engine_id: str | None, coordinator: str | None) -> str:
    """The --kv-transfer-config: HandoffConnector under ``coordinator``, or plain NIXL."""
    if coordinator is None or engine_id is None:
        return json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        )
    return json.dumps(
        {
            "kv_connector": "HandoffConnector",
            "kv_connector_module_path": "handoff_vllm.connector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {
                "handoff": {
                    "coordinator": coordinator,
                    "engine_id": engine_id,
                    "deadline_s": 60,
                    "delivery_timeout_s": 10,
                }
            },
        }
    )


def below_the_coordinator() -> None:
    """In the engine's child, before exec: nice 10 for its new session's autogroup.

    Two engines that spin (a held prefill keeps stepping; vLLM's worker spins
    on sched_yield after every step) starved the coordinator, the test and the
    sidecars on this 2-core machine (bench/RESULTS.md). The engine runs in a
    session of its own, and where the kernel groups tasks by session
    (autogroup) a task's nice only ranks it within its group: the group's own
    nice is what ranks the engine against the coordinator."""
    os.nice(10)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("10")


@dataclass
class Engine:
    """One vLLM OpenAI server on one core, with its own NIXL side channel."""

    name: str
    model: Path
    directory: Path
    core: int
    coordinator: str | None
    engine_id: str | None = None
    port: int = field(default_factory=free_port)
    side_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "tmp").mkdir(exist_ok=True)
        env = {
            **os.environ,
            # vLLM's IPC sockets and its dist-init files go in the temporary
            # directory, and an engine killed with -9 leaves them: in its own.
            "TMPDIR": str(self.directory / "tmp"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            # An idle OpenMP thread sleeps instead of spinning on a core the
            # other engine, the coordinator and the tests need too.
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CACHE_ROOT": str(self.directory / "cache"),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONHASHSEED": "0",
        }
        log = (self.directory / f"{self.name}.log").open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(self.model),
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--enforce-eager",
                "--dtype",
                "float32",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--block-size",
                str(BLOCK_SIZE),
                "--seed",
                "0",
                "--kv-transfer-config",
                kv_transfer_config(self.engine_id, self.coordinator),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.directory,
            start_new_session=True,
            preexec_fn=below_the_coordinator,
        )

    async def ready(self, timeout_s: float = ENGINE_START_S) -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:

            async def healthy() -> bool:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(f"{self.name} exited: {self.log_tail()}")
                try:
                    return (await http.get(f"{self.url}/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            await poll(f"{self.name} healthy at {self.url}", healthy, timeout_s)

    def kill(self) -> None:
        """kill -9 of the whole process group (the API server and its engine core)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def signal(self, number: int) -> None:
        """To the engine's process group and its sidecar, which has a session of its own."""
        assert self.process is not None
        sidecars = self.sidecars()
        os.killpg(self.process.pid, number)
        for pid in sidecars:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def pause_server(self, resume: bool = False) -> None:
        """To the API server alone: its engine core and sidecar run on, so a
        request sent now waits unread while the engine stays live on the
        coordinator (a slow leg, not a lost engine)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT if resume else signal.SIGSTOP)

    def sidecars(self) -> list[int]:
        """Pids of this engine's sidecar processes: descendants running handoff_vllm.sidecar."""
        assert self.process is not None
        root = self.process.pid
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                # pid (comm) state ppid ...: comm may hold spaces, so split after it.
                text = stat.read_text()
                parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])

        def descends(pid: int) -> bool:
            while pid > 1:
                pid = parents.get(pid, 0)
                if pid == root:
                    return True
            return False

        found = []
        for pid in parents:
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"handoff_vllm.sidecar" in command and descends(pid):
                    found.append(pid)
        return found

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.directory / f"{self.name}.log", lines)

    def log_text(self) -> str:
        path = self.directory / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def metrics(self) -> dict[str, float]:
        """vLLM's own gauges, summed over label sets."""
        async with httpx.AsyncClient(timeout=5.0) as http:
            text = (await http.get(f"{self.url}/metrics")).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = METRIC.match(line)
            if match:
                name = match.group(1)
                values[name] = values.get(name, 0.0) + float(match.group(2))
        return values

    async def idle_now(self) -> bool:
        try:
            values = await self.metrics()
        except httpx.TimeoutException:
            return False  # a scrape the starved API server answered late: not known idle
        return (
            values.get("vllm:num_requests_running", 0.0) == 0.0
            and values.get("vllm:num_requests_waiting", 0.0) == 0.0
            and values.get("vllm:kv_cache_usage_perc", 0.0) == 0.0
        )

    async def idle(self, timeout_s: float = 20.0) -> None:
        """Running and waiting 0 and no KV block in use, by vLLM's /metrics."""
        await poll(f"{self.name} idle by its /metrics", self.idle_now, timeout_s)


@dataclass
class Proxy:
    """``handoff proxy`` (from the main venv) in front of one pair."""

    directory: Path
    coordinator: str | None
    prefill: Engine
    decode: Engine
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        where = (
            ["--no-coordinator"]
            if self.coordinator is None
            else [f"--coordinator={self.coordinator}", "--deadline-s=60"]
        )
        log = (self.directory / "proxy.log").open("ab")
        self.process = subprocess.Popen(
            [
                *coordinator_command(),
                "proxy",
                "--host=127.0.0.1",
                f"--port={self.port}",
                f"--prefill={self.prefill.engine_id}={self.prefill.url}",
                f"--decode={self.decode.engine_id}={self.decode.url}",
                "--log-level=info",
                *where,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    async def ready(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:

            async def healthy() -> bool:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(f"proxy exited: {self.log_tail()}")
                try:
                    return (await http.get(f"{self.url}/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            await poll(f"proxy healthy at {self.url}", healthy, 60.0)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.directory / "proxy.log", lines)

    def handoff_ids(self, phrase: str) -> list[str]:
        """The handoff ids of the proxy's log lines that say ``phrase``, oldest first."""
        path = self.directory / "proxy.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return [
            match.group(1)
            for line in text.splitlines()
            if phrase in line and (match := HANDOFF_ID.search(line)) is not None
        ]

    async def metric(self, http: httpx.AsyncClient, name: str, **labels: str) -> float:
        """One sample of the proxy's /metrics (0 when it has none yet)."""
        text = (await http.get(f"{self.url}/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0

    async def metric_above(
        self, http: httpx.AsyncClient, what: str, name: str, floor: float, **labels: str
    ) -> None:
        """Until the proxy's sample ``name`` is above ``floor``."""

        async def above() -> bool:
            return await self.metric(http, name, **labels) > floor

        await poll(f"{what} ({name} {labels} above {floor:g})", above, 30.0)

    async def complete(
        self,
        http: httpx.AsyncClient,
        prompt: str,
        max_tokens: int,
        stream: bool,
        first: Callable[[], None] = lambda: None,
    ) -> tuple[str, str]:
        """(handoff id from X-Request-Id, text) of one completion through the proxy;
        ``first()`` at a streamed answer's first token (a byte-level token may
        carry no text yet: a partial UTF-8 character)."""
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if not stream:
            answer = await http.post(f"{self.url}/v1/completions", json=body)
            if answer.status_code != 200:
                raise LegError("proxy", answer.status_code, answer.text)
            return answer.headers.get("x-request-id", ""), str(answer.json()["choices"][0]["text"])
        text: list[str] = []
        async with http.stream("POST", f"{self.url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                raise LegError("proxy", answer.status_code, (await answer.aread()).decode())
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise LegError("proxy", answer.status_code, line)
                if not text:  # the first token, even one whose text is still empty
                    first()
                text.append(event["choices"][0].get("text") or "")
            return answer.headers.get("x-request-id", ""), "".join(text)


HANDOFF_ID = re.compile(r"handoff_id=([0-9a-f-]{36})")
METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


class LegError(Exception):
    """A P/D leg answered an error: which leg, the status, what it said."""

    def __init__(self, leg: str, status: int, body: str) -> None:
        super().__init__(f"{leg} leg: HTTP {status}: {body[:500]}")
        self.leg, self.status, self.body = leg, status, body


def prefill_params(handoff_id: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    if handoff_id is not None:
        params["handoff_id"] = handoff_id
    return params


async def prefill_leg(
    http: httpx.AsyncClient, url: str, prompt: str, handoff_id: str | None
) -> dict[str, Any]:
    """The prefill leg: one token, and the kv_transfer_params the decode needs."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": prefill_params(handoff_id),
    }
    answer = await http.post(f"{url}/v1/completions", json=body)
    if answer.status_code != 200:
        raise LegError("prefill", answer.status_code, answer.text)
    params = answer.json().get("kv_transfer_params")
    if not isinstance(params, dict):
        raise LegError("prefill", answer.status_code, f"no kv_transfer_params in {answer.text}")
    if handoff_id is not None:
        params["handoff_id"] = handoff_id
    return params


async def decode_leg(
    http: httpx.AsyncClient, url: str, prompt: str, params: dict[str, Any], max_tokens: int
) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "kv_transfer_params": params,
    }
    answer = await http.post(f"{url}/v1/completions", json=body)
    if answer.status_code != 200:
        raise LegError("decode", answer.status_code, answer.text)
    choice = answer.json()["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        raise LegError("decode", answer.status_code, f"finish_reason {choice.get('finish_reason')}")
    return str(choice["text"])


async def decode_stream(
    http: httpx.AsyncClient,
    url: str,
    prompt: str,
    params: dict[str, Any],
    max_tokens: int,
    first: Callable[[], None] = lambda: None,
) -> str:
    """The decode leg streamed; ``first()`` is called at the first token."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "kv_transfer_params": params,
    }
    text: list[str] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise LegError("decode", answer.status_code, (await answer.aread()).decode())
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise LegError("decode", answer.status_code, line)
            choice = event["choices"][0]
            if choice.get("text"):
                if not text:
                    first()
                text.append(choice["text"])
            reason = choice.get("finish_reason")
            if reason is not None and reason not in ("length", "stop"):
                raise LegError("decode", answer.status_code, f"finish_reason {reason}")
    return "".join(text)


async def complete(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> str:
    """One vLLM alone: the reference answer."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    answer = await http.post(f"{url}/v1/completions", json=body)
    if answer.status_code != 200:
        raise LegError("single", answer.status_code, answer.text)
    return str(answer.json()["choices"][0]["text"])


@dataclass
class Pair:
    """A prefill and a decode engine under one coordinator, driven as a frontend does."""

    prefill: Engine
    decode: Engine
    coordinator: Coordinator

    async def start_handoff(self, client: HandoffClient, deadline_s: float = 60.0) -> str:
        handoff_id = str(uuid.uuid4())
        assert self.prefill.engine_id is not None
        assert self.decode.engine_id is not None
        await client.start_handoff(
            handoff_id,
            engine_type=EngineType.VLLM,
            source_engine_id=self.prefill.engine_id,
            destination_engine_id=self.decode.engine_id,
            transfer_executor=Role.DESTINATION,
            fallback_transfer_delay_ms=1.0,
            handoff_timeout_s=deadline_s,
        )
        return handoff_id

    async def generate(
        self, client: HandoffClient, http: httpx.AsyncClient, prompt: str, max_tokens: int
    ) -> tuple[str, str]:
        """(handoff id, text) through both legs with coordination."""
        handoff_id = await self.start_handoff(client)
        params = await prefill_leg(http, self.prefill.url, prompt, handoff_id)
        text = await decode_leg(http, self.decode.url, prompt, params, max_tokens)
        return handoff_id, text


async def ended(
    client: HandoffClient,
    handoff_id: str,
    timeout_s: float = 30.0,
    completion: Completion | None = None,
) -> Handoff:
    """The handoff once COMPLETE on the coordinator (with ``completion``, if given:
    a success that a later Canceled reopens is COMPLETE twice, SUCCESS first)."""
    seen: list[Handoff] = []

    async def complete_now() -> bool:
        handoff = await client.get_handoff(handoff_id)
        seen[:] = [handoff]
        return handoff.phase is Phase.COMPLETE and completion in (None, handoff.completion)

    wanted = "COMPLETE" if completion is None else f"COMPLETE with {completion.name}"
    try:
        await poll(f"handoff {handoff_id} {wanted}", complete_now, timeout_s)
    except AssertionError as error:
        raise AssertionError(f"{error} (last seen: {seen})") from None
    return seen[0]


async def lifecycle_has(client: HandoffClient, handoff_id: str, kind_name: str) -> bool:
    handoff = await client.get_handoff(handoff_id)
    return any(event.kind.name == kind_name for event in handoff.lifecycle)
