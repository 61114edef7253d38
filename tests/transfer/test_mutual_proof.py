"""The data plane's handshake proves the cluster token both ways and never sends it: D proves
itself before P sends anything but its hello, P's proof is checked by D, and no proof is worth
anything on another connection or from the other side."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pd_cluster.cluster_proof import new_nonce
from pd_cluster.transfer import HandshakeRefused
from pd_cluster.transfer.framing import FramedStream, decode_message, read_frame
from pd_cluster.transfer.handshake import PROTOCOL_VERSION, Challenge, Hello, Join, Refused, transcript
from tests.transfer.test_transfer import SPEC, TOKEN, WRONG_TOKEN, DecodeNode, closed_by_peer, pool, start_decode, wait_for_log

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def decode_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeNode]:
    node = start_decode(tmp_path_factory.mktemp("decode") / "decode.log", [0])
    yield node
    node.stop()


async def _open(address: str) -> tuple[asyncio.StreamReader, FramedStream]:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    return reader, FramedStream(reader, writer)


async def _challenge(stream: FramedStream, hello: Hello) -> Challenge:
    await stream.send(hello, 5)
    challenge = await stream.receive(5)
    assert isinstance(challenge, Challenge)
    return challenge


def _no_secret_in(log: str) -> None:
    assert TOKEN not in log and WRONG_TOKEN not in log


# ---- P checks D -----------------------------------------------------------------------------


class Impostor:
    """A plain asyncio server on "a dead D's old address": it records every byte P sends and
    answers the hello with a challenge it made up (or one recorded from the real D)."""

    def __init__(self, challenge: Challenge | None = None) -> None:
        self.challenge = challenge
        self.received = b""
        self.frames: list[str] = []
        self.done = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FramedStream(reader, writer)
        try:
            hello = decode_message(await read_frame(reader, 5))
            self.frames.append(hello.type)
            challenge = self.challenge or Challenge(node_id="decode-0", nonce=new_nonce(), proof=new_nonce())
            await stream.send(challenge, 5)
            self.received = await asyncio.wait_for(reader.read(), 5)  # whatever P sends until it hangs up
        finally:
            writer.close()
            self.done.set()


@pytest.mark.parametrize("how", ["made up", "replayed from the real D"])
async def test_p_refuses_an_impostor_d_and_sends_it_neither_token_nor_proof(decode_node: DecodeNode, how: str) -> None:
    recorded = None
    if how != "made up":  # the real D's proof on an earlier connection of the impostor's own
        _, stream = await _open(decode_node.addresses[0])
        recorded = await _challenge(stream, Hello(node_id="prefill-0", nonce=new_nonce()))
        await stream.aclose()
    impostor = Impostor(recorded)
    async with impostor as address:
        p = pool()
        with pytest.raises(HandshakeRefused, match="could not prove it holds the cluster token"):
            await p.get(address)
        await asyncio.wait_for(impostor.done.wait(), 5)
    assert len(p) == 0
    assert impostor.frames == ["dp.hello"]
    assert impostor.received == b""  # nothing after the hello: no proof, no KV, no job
    assert TOKEN.encode() not in impostor.received


# ---- D checks P -----------------------------------------------------------------------------


async def test_p_with_the_wrong_token_refuses_d_and_d_refuses_its_proof(decode_node: DecodeNode) -> None:
    # A P with another token cannot check D's proof: it stops before it proves anything.
    p = pool(token=WRONG_TOKEN)
    with pytest.raises(HandshakeRefused, match="could not prove it holds the cluster token"):
        await p.get(decode_node.addresses[0])
    assert len(p) == 0

    # One that sends a proof anyway (made with its token) is refused by D.
    reader, stream = await _open(decode_node.addresses[0])
    hello = Hello(node_id="intruder", nonce=new_nonce())
    challenge = await _challenge(stream, hello)
    proof = transcript(hello, challenge.node_id, challenge.nonce).prove(WRONG_TOKEN, "dialer")
    await stream.send(Join(proof=proof, kv_spec=SPEC, device_type="cpu"), 5)
    answer = await stream.receive(5)
    assert isinstance(answer, Refused) and answer.reason == "authentication failed"
    assert await closed_by_peer(reader)
    await stream.aclose()
    log = await wait_for_log(decode_node, "(node 'intruder'): authentication failed")
    assert "refused data-plane peer" in log
    _no_secret_in(log)


async def test_a_replayed_proof_is_refused(decode_node: DecodeNode) -> None:
    # A proof that went over the wire: D accepted it (it refuses the join for the device, checked after).
    reader, stream = await _open(decode_node.addresses[0])
    hello = Hello(node_id="replayer", nonce=new_nonce())
    challenge = await _challenge(stream, hello)
    proof = transcript(hello, challenge.node_id, challenge.nonce).prove(TOKEN, "dialer")
    await stream.send(Join(proof=proof, kv_spec=SPEC, device_type="cuda"), 5)
    answer = await stream.receive(5)
    assert isinstance(answer, Refused) and answer.reason.startswith("device type mismatch")
    await stream.aclose()

    # The same hello and proof on a new connection: D's nonce differs, the proof is worthless.
    reader, stream = await _open(decode_node.addresses[0])
    again = await _challenge(stream, hello)
    assert again.nonce != challenge.nonce
    await stream.send(Join(proof=proof, kv_spec=SPEC, device_type="cuda"), 5)
    answer = await stream.receive(5)
    assert isinstance(answer, Refused) and answer.reason == "authentication failed"
    assert await closed_by_peer(reader)
    await stream.aclose()


async def test_d_s_own_proof_reflected_back_is_refused(decode_node: DecodeNode) -> None:
    reader, stream = await _open(decode_node.addresses[0])
    challenge = await _challenge(stream, Hello(node_id="reflector", nonce=new_nonce()))
    await stream.send(Join(proof=challenge.proof, kv_spec=SPEC, device_type="cpu"), 5)
    answer = await stream.receive(5)
    assert isinstance(answer, Refused) and answer.reason == "authentication failed"
    assert await closed_by_peer(reader)
    await stream.aclose()
    _no_secret_in(await wait_for_log(decode_node, "(node 'reflector'): authentication failed"))


async def test_an_old_hello_with_the_token_in_it_is_refused_by_version(decode_node: DecodeNode) -> None:
    reader, stream = await _open(decode_node.addresses[0])
    old = b'{"type": "dp.hello", "version": 1, "token": "%s", "node_id": "old-p"}' % TOKEN.encode()
    stream.writer.write(len(old).to_bytes(4, "big") + old)
    answer = await stream.receive(5)
    assert isinstance(answer, Refused) and f"protocol version {PROTOCOL_VERSION} expected" in answer.reason
    assert TOKEN not in answer.reason
    assert await closed_by_peer(reader)
    await stream.aclose()
    _no_secret_in(decode_node.log())
