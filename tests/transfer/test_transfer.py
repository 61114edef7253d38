"""Data plane between a prefill (P) and a decode (D) node, each in its own process, over gloo.

D runs in a process of its own (several servers on loopback, logging to a file the tests read);
P is the test process itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing as mp
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch

from pd_cluster.cluster_proof import new_nonce
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer import (
    MAX_FRAME_BYTES,
    ChannelError,
    ChannelKeeper,
    ChannelPool,
    DataMessage,
    DataPlaneServer,
    FrameError,
    HandshakeRefused,
    PeerConnection,
    RemoteError,
)
from pd_cluster.transfer.framing import FramedStream, decode_message, read_frame
from pd_cluster.transfer.handshake import Challenge, Hello, Join, Refused, transcript
from tests.process_server import forkserver_context

pytestmark = pytest.mark.timeout(60)

TOKEN = "cluster-secret-7d41"
WRONG_TOKEN = "not-the-secret-19ab"
SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
REQUEST_TIMEOUT = 10.0


# ---- messages the test nodes speak --------------------------------------------------------


class Echo(DataMessage):
    type: Literal["test.echo"] = "test.echo"
    text: str


class Echoed(DataMessage):
    type: Literal["test.echoed"] = "test.echoed"
    text: str
    peer_node_id: str
    server_node_id: str


class PushTensors(DataMessage):
    """Announces the tensors that follow, in order."""

    type: Literal["test.push"] = "test.push"
    shapes: list[list[int]]
    dtypes: list[str]


class Received(DataMessage):
    type: Literal["test.received"] = "test.received"
    digests: list[str]
    bytes_received: int
    device: str


class PullTensor(DataMessage):
    """Asks D to send a tensor back (``arange`` of this many float32 values)."""

    type: Literal["test.pull"] = "test.pull"
    numel: int


class Stall(DataMessage):
    """D logs 'stalling', optionally receives the announced tensor first, then sleeps."""

    type: Literal["test.stall"] = "test.stall"
    seconds: float
    receive_first: bool
    shape: list[int]


class Stats(DataMessage):
    type: Literal["test.stats"] = "test.stats"


class StatsReply(DataMessage):
    type: Literal["test.stats_reply"] = "test.stats_reply"
    connections: int
    warmed: list[str] = []


class Boom(DataMessage):
    type: Literal["test.boom"] = "test.boom"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---- the decode process ---------------------------------------------------------------------


def _make_handler(server_ref: list[DataPlaneServer]):
    log = logging.getLogger("test.decode")

    async def handler(conn: PeerConnection, msg: DataMessage) -> DataMessage | None:
        server = server_ref[0]
        if isinstance(msg, Echo):
            return Echoed(text=msg.text, peer_node_id=conn.peer_node_id, server_node_id=server.node_id)
        if isinstance(msg, PushTensors):
            tensors = await conn.recv_tensors(list(zip(msg.shapes, msg.dtypes)), REQUEST_TIMEOUT)
            return Received(digests=[digest(t) for t in tensors], bytes_received=conn.bytes_received, device=str(tensors[0].device))
        if isinstance(msg, PullTensor):
            await conn.send_tensor(torch.arange(msg.numel, dtype=torch.float32), REQUEST_TIMEOUT)
            return Echoed(text="pulled", peer_node_id=conn.peer_node_id, server_node_id=server.node_id)
        if isinstance(msg, Stall):
            if msg.receive_first:
                await conn.recv_tensor(msg.shape, "float32", REQUEST_TIMEOUT)
            log.info("stalling on %s", server.address)
            await asyncio.sleep(msg.seconds)
            return Echoed(text="woke", peer_node_id=conn.peer_node_id, server_node_id=server.node_id)
        if isinstance(msg, Stats):
            return StatsReply(connections=len(server.connections), warmed=server.warmed_peers)
        if isinstance(msg, Boom):
            raise RuntimeError("boom")
        raise ValueError(f"unexpected {msg.type}")

    return handler


async def _decode_main(ports: list[int], ready, device: str) -> None:
    servers = []
    for i, port in enumerate(ports):
        ref: list[DataPlaneServer] = []
        server = DataPlaneServer("127.0.0.1", port, TOKEN, SPEC, f"decode-{i}", device, _make_handler(ref), handshake_timeout=5.0)
        ref.append(server)
        await server.start()
        servers.append(server)
    ready.put([s.address for s in servers])
    await asyncio.Event().wait()  # serve until killed


def _decode_process(ports: list[int], log_path: str, ready, device: str) -> None:
    logging.basicConfig(filename=log_path, level=logging.INFO, format="%(levelname)s %(name)s %(message)s", force=True)
    asyncio.run(_decode_main(ports, ready, device))


@dataclass
class DecodeNode:
    process: mp.process.BaseProcess
    addresses: list[str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def start_decode(log_path: Path, ports: list[int], device: str = "cpu") -> DecodeNode:
    ctx = forkserver_context()  # a fresh process, without importing torch again (tests/process_server.py)
    ready = ctx.Queue()
    process = ctx.Process(target=_decode_process, args=(ports, str(log_path), ready, device), daemon=True)
    process.start()
    try:
        addresses = ready.get(timeout=30)
    except Exception:
        process.kill()
        raise
    return DecodeNode(process, addresses, log_path)


@pytest.fixture(scope="module")
def decode_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeNode]:
    """One D process with three servers (three addresses for the LRU test)."""
    node = start_decode(tmp_path_factory.mktemp("decode") / "decode.log", [0, 0, 0])
    yield node
    node.stop()


async def wait_for_log(node: DecodeNode, text: str, timeout: float = 10.0, count: int = 1) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = node.log()
        if log.count(text) >= count:
            return log
        await asyncio.sleep(0.05)
    raise AssertionError(f"{text!r} not in the decode log within {timeout}s:\n{node.log()}")


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    data = await asyncio.wait_for(reader.read(), timeout)
    return data == b""


def pool(token: str = TOKEN, spec: KVSpec = SPEC, max_channels: int = 8, device: str = "cpu") -> ChannelPool:
    return ChannelPool(token, spec, "prefill-0", device, max_channels=max_channels, connect_timeout=10.0)


# ---- in-process checks --------------------------------------------------------------------


def test_handshake_frames_never_show_a_proof() -> None:
    join = Join(proof="ab" * 32, kv_spec=SPEC, device_type="cpu")
    assert "ab" * 32 not in repr(join) and "ab" * 32 not in str(join)
    assert decode_message(join.model_dump_json().encode()).proof == "ab" * 32
    broken = join.model_dump_json().replace('"cpu"', "17").encode()
    with pytest.raises(FrameError) as info:
        decode_message(broken)
    assert "ab" * 32 not in str(info.value)


def test_malformed_frames_are_rejected() -> None:
    for payload, words in [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "string 'type'"),
        (b'{"type": "nope"}', "unknown message type"),
        (b'{"type": "test.echo", "text": 3}', "test.echo"),
        (b'{"type": "test.echo", "text": "a", "extra": 1}', "extra"),
    ]:
        with pytest.raises(FrameError, match=words):
            decode_message(payload)


def test_message_types_must_be_unique() -> None:
    with pytest.raises(TypeError, match="already used"):

        class Clash(DataMessage):  # noqa: F841
            type: Literal["test.echo"] = "test.echo"


# ---- P and D in separate processes ----------------------------------------------------------


async def test_handshake_request_reply_and_tensor_round_trip(decode_node: DecodeNode) -> None:
    p = pool()
    try:
        address = decode_node.addresses[0]
        channel = await p.get(address)
        assert channel.backend == "gloo" and channel.peer_node_id == "decode-0"
        assert await p.get(address) is channel  # reused, not re-dialed

        reply = await channel.request(Echo(text="hi"), REQUEST_TIMEOUT)
        assert reply == Echoed(text="hi", peer_node_id="prefill-0", server_node_id="decode-0")

        # One tensor per layer, mixed dtypes: several sends in order on the wire.
        torch.manual_seed(0)
        layers = [torch.randn(4, 8), torch.randn(3, 5, 2).to(torch.bfloat16), torch.randn(7).to(torch.float16)]
        nbytes = sum(t.numel() * t.element_size() for t in layers)
        announce = PushTensors(shapes=[list(t.shape) for t in layers], dtypes=[str(t.dtype).removeprefix("torch.") for t in layers])
        reply = await channel.request(announce, REQUEST_TIMEOUT, tensors=layers)
        assert isinstance(reply, Received)
        assert reply.digests == [digest(t) for t in layers]
        assert reply.bytes_received == nbytes and reply.device == "cpu"
        assert channel.bytes_sent == nbytes

        # The raw steps, composed under the channel lock: D sends a tensor back.
        async with channel.exclusive():
            await channel.send(PullTensor(numel=10), REQUEST_TIMEOUT)
            pulled = await channel.recv_tensor((10,), torch.float32, REQUEST_TIMEOUT)
            assert isinstance(await channel.receive(REQUEST_TIMEOUT), Echoed)
        assert torch.equal(pulled, torch.arange(10, dtype=torch.float32))
        assert channel.bytes_received == 40
        assert p.bytes_sent == nbytes and p.bytes_received == 40
    finally:
        await p.close()
    assert channel.closed and len(p) == 0


async def test_kv_spec_mismatch_is_refused_naming_the_field(decode_node: DecodeNode) -> None:
    p = pool(spec=SPEC.model_copy(update={"num_layers": 30}))
    with pytest.raises(HandshakeRefused, match="KV spec mismatch: num_layers 30 != 2"):
        await p.get(decode_node.addresses[0])
    assert len(p) == 0
    await wait_for_log(decode_node, "KV spec mismatch: num_layers 30 != 2")

    # A GPU node dialing a CPU node is refused too (hand-made join: this box has no GPU).
    reader, writer = await asyncio.open_connection(*decode_node.addresses[0].split(":"))
    stream = FramedStream(reader, writer)
    hello = Hello(node_id="gpu-p", nonce=new_nonce())
    await stream.send(hello, 5)
    challenge = await stream.receive(5)
    assert isinstance(challenge, Challenge)
    proof = transcript(hello, challenge.node_id, challenge.nonce).prove(TOKEN, "dialer")
    await stream.send(Join(proof=proof, kv_spec=SPEC, device_type="cuda"), 5)
    answer = await stream.receive(5)
    assert isinstance(answer, Refused) and answer.reason == "device type mismatch: cuda != cpu"
    assert await closed_by_peer(reader)
    await stream.aclose()


async def test_pool_closes_least_recently_used_channel(decode_node: DecodeNode) -> None:
    a, b, c = decode_node.addresses
    p = pool(max_channels=2)
    try:
        chan_a = await p.get(a)
        chan_b = await p.get(b)
        assert await p.get(a) is chan_a  # a is now the most recently used
        chan_c = await p.get(c)
        assert p.addresses == [a, c]
        assert chan_b.closed and not chan_b.alive
        assert chan_b.channel.closed  # its process group was torn down
        assert chan_a.alive and chan_c.alive
        assert isinstance(await chan_a.request(Echo(text="still here"), REQUEST_TIMEOUT), Echoed)

        # D dropped the evicted connection too: a fresh dial to b finds itself alone there.
        chan_b2 = await p.get(b)
        assert chan_b2 is not chan_b and p.addresses == [a, b]  # c was the LRU this time
        deadline = time.monotonic() + 10
        while (await chan_b2.request(Stats(), REQUEST_TIMEOUT)).connections != 1:
            assert time.monotonic() < deadline, "D kept the evicted connection"
            await asyncio.sleep(0.05)
    finally:
        await p.close()


async def test_stalled_peer_fails_the_transfer_at_its_deadline(decode_node: DecodeNode) -> None:
    address = decode_node.addresses[0]
    p = pool()
    try:
        channel = await p.get(address)
        start = time.monotonic()
        with pytest.raises(ChannelError):
            # D never posts the receive, so the send can only end by its deadline.
            await channel.request(Stall(seconds=3, receive_first=False, shape=[4]), 1.0, tensors=torch.zeros(1 << 20))
        assert time.monotonic() - start < 1.0 + 2.5
        assert channel.closed and address not in p
        fresh = await p.get(address)
        assert fresh is not channel
        assert isinstance(await fresh.request(Echo(text="again"), REQUEST_TIMEOUT), Echoed)
    finally:
        await p.close()


@pytest.mark.timeout(90)
async def test_dead_decode_node_fails_fast_and_the_pool_redials(tmp_path: Path) -> None:
    node = start_decode(tmp_path / "d1.log", [0])
    address = node.addresses[0]
    port = int(address.rsplit(":", 1)[1])
    p = pool()
    try:
        # Killed while P is still sending the tensor, then while P waits for the reply.
        for receive_first in (False, True):
            channel = await p.get(address)
            stall = Stall(seconds=60, receive_first=receive_first, shape=[1 << 18])
            task = asyncio.create_task(channel.request(stall, REQUEST_TIMEOUT, tensors=torch.ones(1 << 18)))
            await wait_for_log(node, "stalling")
            node.stop()
            killed = time.monotonic()
            with pytest.raises(ChannelError):
                await asyncio.wait_for(task, REQUEST_TIMEOUT + 5)
            assert time.monotonic() - killed < REQUEST_TIMEOUT / 2, "the dead peer was waited on"
            assert channel.closed and address not in p

            node = start_decode(tmp_path / f"d-{receive_first}.log", [port])  # same address
            fresh = await p.get(address)
            assert fresh is not channel
            assert isinstance(await fresh.request(Echo(text="new D"), REQUEST_TIMEOUT), Echoed)
    finally:
        await p.close()
        node.stop()


async def test_bad_frames_close_that_connection_and_the_server_keeps_serving(decode_node: DecodeNode) -> None:
    host, port = decode_node.addresses[1].split(":")
    bad_frames = [
        struct.pack("!I", MAX_FRAME_BYTES + 1) + b"x" * 16,  # oversized: not even read
        struct.pack("!I", 9) + b"not json!",
        struct.pack("!I", 16) + b'{"type": "nope"}',
    ]
    for frame in bad_frames:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(frame)
        await writer.drain()
        answer = await read_frame(reader, 5)  # D says why (a peer of another version learns it) ...
        refused = decode_message(answer)
        assert isinstance(refused, Refused) and refused.reason.startswith("malformed hello")
        assert await closed_by_peer(reader)  # ... and closes
        writer.close()
    log = await wait_for_log(decode_node, "unknown message type 'nope'")
    assert "exceeds" in log and "invalid JSON" in log

    p = pool()
    try:
        channel = await p.get(decode_node.addresses[1])
        # Garbage after the handshake closes that connection as well ...
        channel.stream.writer.write(struct.pack("!I", 5) + b"{{{{{")
        deadline = time.monotonic() + 5
        while channel.alive:
            assert time.monotonic() < deadline, "D kept a connection that sent garbage"
            await asyncio.sleep(0.02)
        # ... and the server still serves: the pool re-dials.
        fresh = await p.get(decode_node.addresses[1])
        assert fresh is not channel
        assert isinstance(await fresh.request(Echo(text="ok"), REQUEST_TIMEOUT), Echoed)
    finally:
        await p.close()


async def test_handler_failure_is_reported_and_closes_only_that_connection(decode_node: DecodeNode) -> None:
    p = pool()
    try:
        channel = await p.get(decode_node.addresses[2])
        with pytest.raises(RemoteError, match="boom"):
            await channel.request(Boom(), REQUEST_TIMEOUT)
        assert channel.closed and decode_node.addresses[2] not in p
        fresh = await p.get(decode_node.addresses[2])
        assert isinstance(await fresh.request(Echo(text="after boom"), REQUEST_TIMEOUT), Echoed)
    finally:
        await p.close()


# ---- warm channels ahead of requests -------------------------------------------------------


async def test_warm_up_moves_one_block_through_the_pair_without_counting_it(decode_node: DecodeNode) -> None:
    address = decode_node.addresses[0]
    p = pool()
    try:
        channel = await p.warm(address, REQUEST_TIMEOUT)
        assert channel.warmed and channel.alive and address in p
        assert channel.bytes_sent == 0 and p.bytes_sent == 0  # a warm-up is not KV
        assert await p.warm(address, REQUEST_TIMEOUT) is channel  # warm already: no new dial
        log = await wait_for_log(decode_node, "channel from prefill node 'prefill-0' warmed")
        block_bytes = 2 * SPEC.num_layers * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim * 4
        assert f"warmed ({block_bytes} bytes over gloo)" in log
        stats = await channel.request(Stats(), REQUEST_TIMEOUT)
        assert stats.warmed == ["prefill-0"]  # the handler never saw the warm-up: the server took it
        # The channel carries KV as before, counted.
        reply = await channel.request(PushTensors(shapes=[[3, 4]], dtypes=["float32"]), REQUEST_TIMEOUT,
                                      tensors=torch.ones(3, 4))
        assert isinstance(reply, Received) and reply.bytes_received == 48 and channel.bytes_sent == 48
    finally:
        await p.close()


def _closed_port_address() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def _until(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return value


async def test_keeper_warms_listed_nodes_within_the_bound_and_closes_unlisted_ones(decode_node: DecodeNode) -> None:
    a, b, c = decode_node.addresses
    p = pool(max_channels=2)
    changes: list[list[str]] = []
    keeper = ChannelKeeper(p, on_change=changes.append, retry_s=0.05, max_backoff_s=0.2, check_s=0.05, idle_close_s=0.0)
    keeper.start()
    try:
        keeper.set_peers({"decode-0": a})
        await _until(lambda: keeper.warm_peers == ["decode-0"], "the first node warm")
        assert p.peek(a).warmed and keeper.setup_seconds is not None
        # The listener hears of a change on the keeper's next pass (warm_peers reads the pool at once).
        await _until(lambda: changes and changes[-1] == ["decode-0"], "the change reported")

        # A node that joins later is warmed too, with nothing evicted.
        keeper.set_peers({"decode-0": a, "decode-1": b})
        await _until(lambda: keeper.warm_peers == ["decode-0", "decode-1"], "the second node warm")
        first = p.peek(a)

        # Beyond max_channels the keeper makes no room: requests would evict a warm channel.
        keeper.set_peers({"decode-0": a, "decode-1": b, "decode-2": c})
        await asyncio.sleep(0.5)
        assert keeper.warm_peers == ["decode-0", "decode-1"] and c not in p and p.peek(a) is first

        # Nodes no longer listed (drained, gone) get their channels closed, which makes room.
        keeper.set_peers({"decode-2": c})
        await _until(lambda: keeper.warm_peers == ["decode-2"], "the third node warm")
        await _until(lambda: p.addresses == [c], "the unlisted channels closed")
        assert first.closed and first.channel.closed
        await _until(lambda: changes[-1] == ["decode-2"], "the change reported")
        stats = await p.peek(c).request(Stats(), REQUEST_TIMEOUT)
        assert stats.connections == 1 and stats.warmed == ["prefill-0"]
    finally:
        await keeper.close()
        await p.close()


async def test_keeper_leaves_channels_alone_before_its_first_list_and_while_requests_use_them(
    decode_node: DecodeNode,
) -> None:
    a, b, _ = decode_node.addresses
    p = pool()
    busy = {b}
    keeper = ChannelKeeper(p, in_use=lambda address: address in busy, check_s=0.05, idle_close_s=0.0)
    keeper.start()
    try:
        dialed = await p.get(a)  # a request dialed it before the master said anything
        await asyncio.sleep(0.3)
        assert dialed.alive and p.addresses == [a] and not dialed.warmed
        # Listed: the request's channel is warmed in place, not dialed again.
        keeper.set_peers({"decode-0": a})
        await _until(lambda: keeper.warm_peers == ["decode-0"], "the dialed channel warm")
        assert p.peek(a) is dialed and dialed.warmed

        # A request still runs on a channel to a node no longer listed: it stays open until it ends.
        in_flight = await p.get(b)
        keeper.set_peers({})
        await _until(lambda: p.addresses == [b], "the idle unlisted channel closed")
        await asyncio.sleep(0.3)
        assert in_flight.alive
        busy.clear()
        await _until(lambda: len(p) == 0, "the channel closed once its request ended")
    finally:
        await keeper.close()
        await p.close()


async def test_keeper_retries_a_failed_warm_up_until_the_node_answers() -> None:
    address = _closed_port_address()
    port = int(address.rsplit(":", 1)[1])
    p = pool()
    keeper = ChannelKeeper(p, retry_s=0.05, max_backoff_s=0.2, check_s=0.05)
    keeper.start()
    ref: list[DataPlaneServer] = []
    server = DataPlaneServer("127.0.0.1", port, TOKEN, SPEC, "decode-late", "cpu", _make_handler(ref))
    ref.append(server)
    try:
        keeper.set_peers({"decode-late": address})
        await _until(lambda: keeper.failures >= 3, "retries with backoff")
        assert keeper.warm_peers == [] and len(p) == 0
        await server.start()  # the node comes up at its listed address
        await _until(lambda: keeper.warm_peers == ["decode-late"], "the late node warm")
        assert server.warmed_peers == ["prefill-0"]
        # A warm channel whose peer dies drops out at the next check.
        await server.stop()
        await _until(lambda: keeper.warm_peers == [], "the dead channel dropped")
    finally:
        await keeper.close()
        await p.close()
        await server.stop()


# ---- server lifecycle (both ends in this process: only the server's own behaviour matters) ----


async def test_server_stop_and_idle_timeout_close_connections_and_groups() -> None:
    ref: list[DataPlaneServer] = []
    server = DataPlaneServer("127.0.0.1", 0, TOKEN, SPEC, "decode-local", "cpu", _make_handler(ref), idle_timeout=1.5)
    ref.append(server)
    await server.start()
    p = pool()
    try:
        # An idle connection is closed by D; the pool notices and dials a new one.
        idle = await p.get(server.address)
        deadline = time.monotonic() + 5
        while idle.alive:
            assert time.monotonic() < deadline, "idle connection was never closed"
            await asyncio.sleep(0.05)
        channel = await p.get(server.address)
        assert channel is not idle and idle.closed
        assert isinstance(await channel.request(Echo(text="x"), REQUEST_TIMEOUT), Echoed)
        (conn,) = server.connections

        await server.stop()
        assert server.connections == [] and conn.channel.closed
        deadline = time.monotonic() + 5
        while channel.alive:
            assert time.monotonic() < deadline, "P never saw the server stop"
            await asyncio.sleep(0.02)
        with pytest.raises(ChannelError, match="cannot connect"):
            await p.get(server.address)  # not the dead channel: a new dial, and nobody listens
    finally:
        await p.close()
        await server.stop()


# ---- on GPUs (run on a GPU machine: ``-m gpu``) ---------------------------------------------


def _layers(device: str) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(64, 1024, 8).to(device=device, dtype=torch.bfloat16) for _ in range(4)]


async def _push_and_check(channel, layers: list[torch.Tensor]) -> Received:
    announce = PushTensors(shapes=[list(t.shape) for t in layers], dtypes=["bfloat16"] * len(layers))
    reply = await channel.request(announce, 30, tensors=layers)
    assert isinstance(reply, Received)
    assert reply.digests == [digest(t) for t in layers]
    return reply


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs two GPUs")
@pytest.mark.timeout(240)
def test_nccl_channel_between_two_gpus_survives_stalled_and_dead_peers(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = start_decode(tmp_path / "d0.log", [0], device="cuda:0")
        address = node.addresses[0]
        p = pool(device="cuda:1")
        try:
            channel = await p.get(address)
            assert channel.backend == "nccl"
            layers = _layers("cuda:1")
            reply = await _push_and_check(channel, layers)
            assert reply.device == "cuda:0" and reply.bytes_received == channel.bytes_sent

            # D never receives a 512 MiB send: it ends at its deadline, and the aborted group
            # leaves no kernel spinning on the GPU.
            big = torch.ones(1 << 28, dtype=torch.bfloat16, device="cuda:1")
            start = time.monotonic()
            with pytest.raises(ChannelError):
                await channel.request(Stall(seconds=5, receive_first=False, shape=[1]), 3.0, tensors=big)
            assert time.monotonic() - start < 3.0 + 2.5
            await channel.aclose()
            await asyncio.wait_for(asyncio.to_thread(torch.cuda.synchronize, 1), 10)

            # D killed while P is blocked sending: NCCL would wait; the hung-up control
            # connection ends it at once, and this process lives on.
            channel = await p.get(address)
            task = asyncio.create_task(channel.request(Stall(seconds=60, receive_first=False, shape=[1]), 30, tensors=big))
            await wait_for_log(node, "stalling", count=2)
            node.stop()
            killed = time.monotonic()
            with pytest.raises(ChannelError):
                await task
            assert time.monotonic() - killed < 5
            node = start_decode(tmp_path / "d1.log", [int(address.rsplit(":", 1)[1])], device="cuda:0")
            fresh = await p.get(address)
            assert fresh is not channel and fresh.backend == "nccl"
            await _push_and_check(fresh, layers)
        finally:
            await p.close()
            node.stop()

    asyncio.run(scenario())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_two_ends_on_one_gpu_stage_through_gloo(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = start_decode(tmp_path / "d.log", [0], device="cuda:0")
        p = pool(device="cuda:0")
        try:
            channel = await p.get(node.addresses[0])
            assert channel.backend == "gloo"  # NCCL refuses two ranks on one device
            reply = await _push_and_check(channel, _layers("cuda:0"))
            assert reply.device == "cuda:0"
        finally:
            await p.close()
            node.stop()

    asyncio.run(scenario())
