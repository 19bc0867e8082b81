"""Shards: placement, shard identity, misrouted starts, the shard map, routing clients.

Servers here are real (in-process, on loopback gRPC); tests/service/test_shards_process.py
runs `handoff serve` processes for what needs restarts and state dirs.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from handoff_client import HandoffClient, Order, routing
from handoff_client import placement as placement_module
from handoff_client.errors import MisroutedError, NotFoundError, error_for
from handoff_client.placement import ShardInfo, ShardMap, place
from handoff_client.retry import Backoff, RetryPolicy
from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc
from handoff_server.commands import cli, serve
from handoff_server.commands.conformance import Vector
from handoff_server.ops.config import Settings
from handoff_server.ops.metrics import Metrics
from handoff_server.service.app import Server
from handoff_server.service.shards import ShardIdentity, Shards, ShardSettingsError
from tests.service.test_conformance_grpc import CONCURRENCY, run_vector
from tests.support.fakes import free_port
from tests.support.rpc import DESTINATION, SOURCE, ConnectEngine, StreamRecorder
from tests.support.servers import FAST_RECONNECT, StartServer
from tests.support.vectors import LOST_VECTORS, VECTORS, all_vectors

TIMEOUT_S = 30
NAMES = ("handoff-0", "handoff-1", "handoff-2")
ROOT = Path(__file__).resolve().parents[2]


def seeded_ids(count: int, seed: int = 13) -> list[str]:
    rng = random.Random(seed)
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


# --- placement ------------------------------------------------------------------


def test_placement_is_balanced_over_three_shards() -> None:
    ids = seeded_ids(10_000)
    counts = Counter(place(h, NAMES) for h in ids)
    assert set(counts) == set(NAMES)
    for name in NAMES:
        assert abs(counts[name] - len(ids) / 3) <= 0.05 * len(ids) / 3, counts


def test_placement_is_the_same_in_another_process() -> None:
    """No per-process salt (Python's hash() has one): another interpreter places alike."""
    ids = seeded_ids(2_000)
    program = (
        "import sys\n"
        "from handoff_client.placement import place\n"
        f"names = {NAMES!r}\n"
        "print('\\n'.join(place(h, names) for h in sys.stdin.read().split()))\n"
    )
    elsewhere = subprocess.run(
        [sys.executable, "-c", program],
        input="\n".join(ids),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert elsewhere == [place(h, NAMES) for h in ids]


def test_placement_ties_go_to_the_lower_ordinal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_module, "score", lambda name, handoff_id: 7)
    assert place("any", NAMES) == "handoff-0"


def test_placement_moves_only_ids_the_new_shard_wins() -> None:
    """Rendezvous: adding a shard takes ids only for itself, never between old shards."""
    ids = seeded_ids(3_000)
    for h in ids:
        before, after = place(h, NAMES[:2]), place(h, NAMES)
        assert after in (before, "handoff-2")


def test_a_shard_map_places_over_its_placing_shards_only() -> None:
    shard_map = ShardMap(
        (
            ShardInfo("handoff-0", "a:1"),
            ShardInfo("handoff-1", "b:1"),
            ShardInfo("s-2", "c:1", False),
        )
    )
    assert shard_map.placing == ("handoff-0", "handoff-1")
    assert {shard_map.owner_of(h) for h in seeded_ids(200)} == {"handoff-0", "handoff-1"}
    with pytest.raises(ValueError, match="each shard once"):
        ShardMap.of([("x", "a:1"), ("x", "b:1")])


# --- shard identity -------------------------------------------------------------


def test_identity_comes_from_a_statefulset_hostname() -> None:
    identity = ShardIdentity.resolve(Settings(shard_count=3), "handoff-2")
    assert (identity.name, identity.names) == ("handoff-2", NAMES)
    fqdn = ShardIdentity.resolve(Settings(shard_count=4), "coord-3.handoff-shards.ns.svc")
    assert fqdn.name == "coord-3"
    assert fqdn.placing == ("coord-0", "coord-1", "coord-2", "coord-3")


def test_identity_from_settings_wins_over_the_hostname() -> None:
    settings = Settings(shard_count=3, shard_ordinal=1, shard_name_prefix="hc", placing_shards=2)
    identity = ShardIdentity.resolve(settings, "handoff-2")
    assert identity.name == "hc-1"
    assert identity.placing == ("hc-0", "hc-1")


def test_a_single_coordinator_needs_no_ordinal() -> None:
    assert ShardIdentity.resolve(Settings(), "laptop").names == ("handoff-0",)
    assert ShardIdentity.resolve(Settings(), "web-7").names == ("web-0",)


def test_an_unknown_or_impossible_ordinal_is_refused() -> None:
    with pytest.raises(ShardSettingsError, match=r"does not end in -K.*--shard-ordinal"):
        ShardIdentity.resolve(Settings(shard_count=3), "laptop")
    with pytest.raises(ShardSettingsError, match=r"ordinal is 5 .*shard_count is 3"):
        ShardIdentity.resolve(Settings(shard_count=3), "handoff-5")
    with pytest.raises(ValueError, match="shard_ordinal must be 0 to shard_count-1"):
        Settings(shard_count=3, shard_ordinal=3)
    with pytest.raises(ValueError, match="placing_shards must be 1 to shard_count"):
        Settings(shard_count=2, placing_shards=3)


def test_serve_exits_2_when_the_shard_is_unknown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serve, "hostname", lambda: "laptop")
    assert cli.main(["serve", "--shard-count", "3", "--metrics-port", "-1"]) == 2
    assert "hostname 'laptop' does not end in -K" in capsys.readouterr().err


def test_serve_exits_2_on_an_unreadable_shard_map(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "handoff_server.commands.cli", "serve", "--port", "0"),
            *("--metrics-port", "-1", "--shard-count", "2", "--shard-ordinal", "0"),
            *("--shard-map", str(tmp_path / "missing.json")),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "missing.json" in done.stderr


# --- a three-shard deployment in this process ------------------------------------


async def three_shards(
    start: StartServer, tmp_path: Path, placing: tuple[int, int, int] = (0, 0, 0)
) -> tuple[list[Server], Path]:
    """Shards handoff-0..2 on loopback, their addresses in a shard map file;
    ``placing``: each one's placing_shards (0: all)."""
    ports = [free_port() for _ in NAMES]
    shard_map = tmp_path / "shards.json"
    shard_map.write_text(
        json.dumps({n: f"127.0.0.1:{p}" for n, p in zip(NAMES, ports, strict=True)})
    )
    started = [
        await start(
            port=port,
            shard_count=3,
            shard_ordinal=ordinal,
            shard_map=str(shard_map),
            placing_shards=placing[ordinal],
            shard_name_prefix="handoff",  # not this machine's hostname
        )
        for ordinal, port in enumerate(ports)
    ]
    return started, shard_map


def start_request(handoff_id: str) -> pb.StartHandoffRequest:
    return pb.StartHandoffRequest(
        handoff_id=handoff_id,
        order=pb.HANDOFF_ORDER_SOURCE_FIRST,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
    )


def misrouted(server: Server) -> float:
    value = server.metrics.registry.get_sample_value("handoff_misrouted_starts_total")
    assert value is not None
    return value


@pytest.fixture
async def shards(start_lean_server: StartServer, tmp_path: Path) -> list[Server]:
    started, _ = await three_shards(start_lean_server, tmp_path)
    return started


@pytest.fixture
async def client(shards: list[Server]) -> AsyncIterator[HandoffClient]:
    async with HandoffClient(f"127.0.0.1:{shards[0].port}") as routing:
        yield routing


async def test_the_shard_map_names_every_shard_its_address_and_who_answered(
    shards: list[Server],
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shards[1].port}") as channel:
        answer = await pb_grpc.HandoffCoordinatorStub(channel).GetShardMap(
            pb.GetShardMapRequest(), timeout=TIMEOUT_S
        )
    assert answer.self == "handoff-1"
    assert [(s.name, s.address, s.placing) for s in answer.shards] == [
        (name, f"127.0.0.1:{server.port}", True) for name, server in zip(NAMES, shards, strict=True)
    ]
    info = shards[1].metrics.registry.get_sample_value("handoff_shard_info", {"shard": "handoff-1"})
    assert info == 1


async def test_a_misrouted_start_is_refused_naming_the_owner(shards: list[Server]) -> None:
    handoff_id = next(h for h in seeded_ids(100) if place(h, NAMES) == "handoff-1")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shards[0].port}") as channel:
        stub = pb_grpc.HandoffCoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartHandoff(start_request(handoff_id), timeout=TIMEOUT_S)
    error = refused.value
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == (
        f"handoff {handoff_id}: placed on shard handoff-1, not handoff-0 "
        "(rendezvous over 3 placing shards); route it there"
    )
    typed = error_for(error)  # reads the handoff-owner trailer
    assert isinstance(typed, MisroutedError)
    assert typed.owner == "handoff-1"
    assert handoff_id not in shards[0].registry.handoffs  # refused: nothing changed
    assert misrouted(shards[0]) == 1
    rejected = shards[0].metrics.registry.get_sample_value(
        "handoff_rejections_total", {"rpc": "StartHandoff", "code": "FAILED_PRECONDITION"}
    )
    assert rejected == 1


async def test_the_routing_client_places_every_handoff_on_its_owner(
    shards: list[Server], client: HandoffClient
) -> None:
    ids = seeded_ids(90, seed=2)
    async with asyncio.timeout(TIMEOUT_S):
        updates = await asyncio.gather(
            *(
                client.start_handoff(
                    h,
                    source_engine_id=SOURCE,
                    destination_engine_id=DESTINATION,
                    order=Order.SOURCE_FIRST,
                )
                for h in ids
            )
        )
        for h, update in zip(ids, updates, strict=True):
            owner = place(h, NAMES)
            assert client.owner_of(h) == owner
            assert h in shards[NAMES.index(owner)].registry.handoffs
            assert len(update.actions) == 1  # SubmitPrefill: a real start, on its owner
            canceled = await client.cancel(h, "test")
            assert canceled.handoff.handoff_id == h
            assert (await client.get_handoff(h)).handoff_id == h
    assert [misrouted(s) for s in shards] == [0, 0, 0]
    counts = Counter(place(h, NAMES) for h in ids)
    assert [len(s.registry.handoffs) for s in shards] == [counts[n] for n in NAMES]


async def test_a_draining_shard_gets_no_new_handoffs(
    start_lean_server: StartServer, tmp_path: Path
) -> None:
    shards, _ = await three_shards(start_lean_server, tmp_path, placing=(2, 2, 2))
    ids = seeded_ids(60, seed=5)
    async with HandoffClient(f"127.0.0.1:{shards[2].port}") as client:
        shard_map = await client.shard_map()
        assert [s.placing for s in shard_map.shards] == [True, True, False]
        async with asyncio.timeout(TIMEOUT_S):
            for h in ids:
                await client.start_handoff(
                    h,
                    source_engine_id=SOURCE,
                    destination_engine_id=DESTINATION,
                    order=Order.SOURCE_FIRST,
                )
    assert not shards[2].registry.handoffs
    assert len(shards[0].registry.handoffs) + len(shards[1].registry.handoffs) == len(ids)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shards[2].port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.HandoffCoordinatorStub(channel).StartHandoff(
                start_request(str(uuid.uuid4())), timeout=TIMEOUT_S
            )
    assert "over 2 placing shards" in (refused.value.details() or "")


async def test_a_client_on_another_map_is_redirected_once_by_the_owner(
    start_lean_server: StartServer, tmp_path: Path
) -> None:
    """Mid-rollout of a placing change, shards disagree: the refusal names the owner.

    handoff-0 still says two shards place; handoff-1 and handoff-2 say three.
    A client that learned the map from handoff-0 sends an id handoff-2 wins
    to handoff-1, which refuses it naming handoff-2; the client follows, once.
    """
    shards, _ = await three_shards(start_lean_server, tmp_path, placing=(2, 3, 3))
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    two = ("handoff-0", "handoff-1")
    handoff_id, other = [
        h
        for h in seeded_ids(400, seed=6)
        if place(h, NAMES) == "handoff-2" and place(h, two) == "handoff-1"
    ][:2]
    start = {
        "source_engine_id": SOURCE,
        "destination_engine_id": DESTINATION,
        "order": Order.SOURCE_FIRST,
    }
    async with HandoffClient(addresses[0]) as client:
        async with asyncio.timeout(TIMEOUT_S):
            update = await client.start_handoff(handoff_id, **start)  # type: ignore[arg-type]
        assert update.handoff.handoff_id == handoff_id
        assert client.owner_of(handoff_id) == "handoff-2"
    assert handoff_id in shards[2].registry.handoffs
    assert [misrouted(s) for s in shards] == [0, 1, 0]
    # A client that did not start it places it on handoff-1, which answers
    # NOT_FOUND: the other shards are asked once, and the owner remembered.
    async with HandoffClient(addresses[0]) as stranger:
        async with asyncio.timeout(TIMEOUT_S):
            assert (await stranger.get_handoff(handoff_id)).handoff_id == handoff_id
            assert stranger.owner_of(handoff_id) == "handoff-2"
            with pytest.raises(NotFoundError):
                await stranger.get_handoff(str(uuid.uuid4()))
    # A map without the owner at all (an explicit one): the caller is told.
    partial = {"handoff-0": addresses[0], "handoff-1": addresses[1]}
    async with HandoffClient(addresses[0], shards=partial) as client:
        with pytest.raises(MisroutedError) as refused:
            async with asyncio.timeout(TIMEOUT_S):
                await client.start_handoff(other, **start)  # type: ignore[arg-type]
    assert refused.value.owner == "handoff-2"
    assert other not in shards[1].registry.handoffs


async def test_for_shard_is_bound_to_one_shard(shards: list[Server], client: HandoffClient) -> None:
    await client.shard_map()
    bound = client.for_shard("handoff-2")
    handoff_id = next(h for h in seeded_ids(100, seed=8) if place(h, NAMES) == "handoff-0")
    with pytest.raises(MisroutedError):
        async with asyncio.timeout(TIMEOUT_S):
            await bound.start_handoff(
                handoff_id,
                source_engine_id=SOURCE,
                destination_engine_id=DESTINATION,
                order=Order.SOURCE_FIRST,
            )
    await bound.close()  # leaves the routing client's channel open
    async with asyncio.timeout(TIMEOUT_S):
        await client.start_handoff(
            handoff_id,
            source_engine_id=SOURCE,
            destination_engine_id=DESTINATION,
            order=Order.SOURCE_FIRST,
        )
    with pytest.raises(KeyError, match="no shard named"):
        client.for_shard("handoff-9")


async def test_the_client_follows_a_shard_that_comes_back_on_a_new_address(
    start_lean_server: StartServer, tmp_path: Path
) -> None:
    """The shard map file is rewritten; the next call at that shard learns the new address."""
    shards, shard_map = await three_shards(start_lean_server, tmp_path)
    retry = RetryPolicy(max_attempts=30, backoff=Backoff(initial_s=0.02, max_s=0.2))
    ids = iter(seeded_ids(400, seed=9))
    async with HandoffClient(
        f"127.0.0.1:{shards[0].port}", retry=retry, channel_options=FAST_RECONNECT
    ) as client:
        first = next(h for h in ids if place(h, NAMES) == "handoff-1")
        async with asyncio.timeout(TIMEOUT_S):
            await client.start_handoff(
                first,
                source_engine_id=SOURCE,
                destination_engine_id=DESTINATION,
                order=Order.SOURCE_FIRST,
            )
            await shards[1].stop()
            moved = await start_lean_server(
                port=free_port(),
                shard_count=3,
                shard_ordinal=1,
                shard_map=str(shard_map),
                shard_name_prefix="handoff",
            )
            addresses = json.loads(shard_map.read_text())
            addresses["handoff-1"] = f"127.0.0.1:{moved.port}"
            shard_map.write_text(json.dumps(addresses))
            second = next(h for h in ids if place(h, NAMES) == "handoff-1")
            await client.start_handoff(
                second,
                source_engine_id=SOURCE,
                destination_engine_id=DESTINATION,
                order=Order.SOURCE_FIRST,
            )
            assert second in moved.registry.handoffs
            assert (await client.shard_map()).address("handoff-1") == addresses["handoff-1"]


async def test_one_shard_costs_no_extra_call_per_handoff(lean_server: Server) -> None:
    """A single coordinator: one GetShardMap per client, then every call as before."""
    async with HandoffClient(f"127.0.0.1:{lean_server.port}") as client:
        async with asyncio.timeout(TIMEOUT_S):
            for h in seeded_ids(5, seed=10):
                update = await client.start_handoff(
                    h,
                    source_engine_id=SOURCE,
                    destination_engine_id=DESTINATION,
                    order=Order.SOURCE_FIRST,
                )
                assert client.owner_of(h) == (await client.shard_map()).names[0]
                assert not update.already_started
                with pytest.raises(NotFoundError):
                    await client.get_handoff(str(uuid.uuid4()))
    rejected = lean_server.metrics.registry.get_sample_value(
        "handoff_rejections_total", {"rpc": "GetHandoff", "code": "NOT_FOUND"}
    )
    assert rejected == 5  # no shard was asked twice


# --- conformance through three shards ----------------------------------------------


# Every vector through three shards, each file over one transport: both
# transports route by owner here, and each runs every vector of both files
# against one server in test_conformance_grpc (four runs instead of two would
# add a minute to the suite and test no routing the two do not).
@pytest.mark.parametrize(
    ("vectors_file", "transport"),
    [(VECTORS, "connect"), (LOST_VECTORS, "unary")],
    ids=["connect-vectors", "unary-lost"],
)
async def test_all_vectors_pass_through_three_shards(
    shards: list[Server], vectors_file: Path, transport: str
) -> None:
    """Each vector at the shard that owns its id; each engine holds a stream to every
    shard, as a sidecar does. Unary: facts and outcomes on unary calls to the owner,
    actions on StreamActions. Connect: one packed Connect stream per engine and
    shard, the reports about a handoff on its owner's stream."""
    vectors = all_vectors(vectors_file)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in shards]
    stubs = [pb_grpc.HandoffCoordinatorStub(c) for c in channels]
    sources: list[StreamRecorder] | list[ConnectEngine]
    destinations: list[StreamRecorder] | list[ConnectEngine]
    if transport == "unary":
        sources = [StreamRecorder(stub, SOURCE) for stub in stubs]
        destinations = [StreamRecorder(stub, DESTINATION) for stub in stubs]
    else:
        sources = [ConnectEngine(stub, SOURCE, batch=True) for stub in stubs]
        destinations = [ConnectEngine(stub, DESTINATION, batch=True) for stub in stubs]
    for engine in [*sources, *destinations]:
        await engine.subscribed()
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(vector: Vector) -> object:
        owner = NAMES.index(place(vector.handoff_id, NAMES))
        async with limit:
            return await run_vector(stubs[owner], vector, sources[owner], destinations[owner])

    try:
        # A TaskGroup, not gather: if one vector raises, the others are
        # cancelled and awaited here, before the streams, channels and
        # servers close under them (gather left them running into the
        # teardown: GetHandoff CANCELLED, "handoffs still cleaning up at exit",
        # hiding the first error).
        async with asyncio.timeout(240), asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(v)) for v in vectors]
        results = [task.result() for task in tasks]
    finally:
        for engine in [*sources, *destinations]:
            await engine.close()
        for channel in channels:
            await channel.close(None)
    assert [str(f) for f in results if f is not None] == []
    placed = Counter(place(v.handoff_id, NAMES) for v in vectors)
    for name, server in zip(NAMES, shards, strict=True):
        held = server.registry.handoffs
        assert all(place(h, NAMES) == name for h in held), name
        assert 0 < len(held) <= placed[name]
        assert misrouted(server) == 0


async def test_inspect_finds_a_handoff_on_the_shard_that_owns_it(
    shards: list[Server], client: HandoffClient
) -> None:
    handoff_id = next(h for h in seeded_ids(100, seed=11) if place(h, NAMES) == "handoff-2")
    await client.start_handoff(
        handoff_id,
        source_engine_id=SOURCE,
        destination_engine_id=DESTINATION,
        order=Order.SOURCE_FIRST,
    )
    for target, expected in ((handoff_id, 0), (str(uuid.uuid4()), 1)):
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "handoff_server.commands.cli", "inspect", target),
            *("--target", f"127.0.0.1:{shards[0].port}"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(TIMEOUT_S):
            out, err = await process.communicate()
        assert process.returncode == expected, err
        if expected == 0:
            assert f"handoff      {handoff_id}" in out.decode()
            assert "#0 submit_prefill -> prefill-0" in out.decode()
        else:
            assert f"NOT_FOUND: handoff {target}" in err.decode()


# --- the routing client's own rules ---------------------------------------------------


async def test_an_older_coordinator_is_one_shard() -> None:
    """GetShardMap UNIMPLEMENTED (a server from before shards): one shard, as before."""
    asked: list[str] = []

    async def get_handoff(
        request: pb.GetHandoffRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetHandoffResponse:
        asked.append(request.handoff_id)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"handoff {request.handoff_id}: unknown")
        raise AssertionError("abort raises")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "handoff.v1.HandoffCoordinator",
                {
                    "GetHandoff": grpc.unary_unary_rpc_method_handler(
                        get_handoff,
                        request_deserializer=pb.GetHandoffRequest.FromString,
                        response_serializer=pb.GetHandoffResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    handoff_id = str(uuid.uuid4())
    try:
        async with HandoffClient(target) as client, asyncio.timeout(TIMEOUT_S):
            with pytest.raises(NotFoundError):
                await client.get_handoff(handoff_id)
            assert (await client.shard_map()).shards == (ShardInfo(target, target),)
            assert client.owner_of(handoff_id) == target
    finally:
        await server.stop(None)
    assert asked == [handoff_id]  # asked once: one shard, nowhere else to ask


def test_a_bad_shard_map_file_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "shards.json"
    path.write_text(json.dumps({"handoff-0": "a:1", "handoff-1": "b:1"}))
    settings = Settings(shard_count=2, shard_ordinal=0, shard_map=str(path))
    shards = Shards(settings, ShardIdentity.resolve(settings, "host"), Metrics())
    assert shards.shard_map().address("handoff-1") == "b:1"
    path.write_text('{"handoff-0": "a:1", "handoff-1": ')  # caught mid-write
    assert shards.shard_map().address("handoff-1") == "b:1"
    path.write_text(json.dumps({"handoff-0": "a:1", "handoff-1": "c:2"}))
    assert shards.shard_map().address("handoff-1") == "c:2"


async def test_the_remembered_owners_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "OWNERS_REMEMBERED", 2)
    shard_map = ShardMap.of((name, f"127.0.0.1:{free_port()}") for name in NAMES)
    seed = grpc.aio.insecure_channel(shard_map.address("handoff-0"))
    router = routing.Router(
        seed,
        "seed",
        dial=grpc.aio.insecure_channel,
        fetch=lambda: asyncio.sleep(0, shard_map),
        explicit=shard_map,
    )
    ids = seeded_ids(3, seed=12)
    for h in ids:
        router.remember(h, "handoff-1")
    assert router.owner(ids[0]) is None  # the oldest, forgotten: placed afresh
    assert [router.owner(h) for h in ids[1:]] == ["handoff-1", "handoff-1"]
    await router.close()
    await seed.close(None)


async def test_a_refusal_naming_an_unknown_owner_refetches_the_map_at_once() -> None:
    """Refreshes are rate-limited, but a shard naming an owner the client's map
    lacks (the count grew) is news worth asking for at once."""
    maps = [
        ShardMap.of([("handoff-0", "a:1"), ("handoff-1", "b:1")]),
        ShardMap.of([("handoff-0", "a:1"), ("handoff-1", "b:1"), ("handoff-2", "c:1")]),
    ]
    fetched: list[ShardMap] = []

    async def fetch() -> ShardMap:
        fetched.append(maps[len(fetched)])
        return fetched[-1]

    async with grpc.aio.insecure_channel("127.0.0.1:1") as seed:
        router = routing.Router(
            seed, "a:1", dial=grpc.aio.insecure_channel, fetch=fetch, explicit=None
        )
        assert (await router.shard_map()).names == ("handoff-0", "handoff-1")
        router.stale()
        assert (await router.shard_map()).names == ("handoff-0", "handoff-1")  # rate-limited
        assert len(fetched) == 1
        assert "handoff-2" in (await router.refetch()).names
        assert len(fetched) == 2
