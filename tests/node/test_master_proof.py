"""A node proves the cluster token to its master only after the master proved it: a process on a
master's address that does not hold the token gets a hello and nothing else, and the node stops
with a clear refusal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import websockets
from websockets.asyncio.server import serve

from pd_cluster import protocol
from pd_cluster.cluster_proof import new_nonce
from pd_cluster.node.agent import NodeAgent, RegistrationRefused
from tests.master_fakes import CLUSTER_TOKEN, LiveMaster, make_settings, register_msg, write_model_dir

pytestmark = pytest.mark.timeout(60)


class ImpostorMaster:
    """A websocket server that answers the hello with a challenge it cannot have made honestly
    (made up, or the real master's from another connection) and records every frame."""

    def __init__(self, challenge: protocol.LinkChallenge | None = None) -> None:
        self.challenge = challenge
        self.frames: list[str] = []

    async def handle(self, ws) -> None:
        async for frame in ws:
            self.frames.append(frame)
            if len(self.frames) == 1:
                challenge = self.challenge or protocol.LinkChallenge(master_id="m", nonce=new_nonce(),
                                                                     proof=new_nonce())
                await ws.send(protocol.encode(challenge))


async def _recorded_challenge(tmp_path: Path) -> protocol.LinkChallenge:
    """The real master's proof, for a hello of the impostor's own."""
    async with LiveMaster(make_settings(write_model_dir(tmp_path))) as master:
        async with websockets.connect(master.ws_url) as ws:
            await ws.send(protocol.encode(protocol.LinkHello(node_id="d0", nonce=new_nonce())))
            return protocol.LinkChallenge.model_validate_json(await asyncio.wait_for(ws.recv(), 5.0))


@pytest.mark.parametrize("how", ["made up", "replayed from the real master"])
async def test_node_refuses_a_master_without_the_token_and_sends_it_no_proof(tmp_path: Path, how: str) -> None:
    impostor = ImpostorMaster(await _recorded_challenge(tmp_path) if how != "made up" else None)
    async with serve(impostor.handle, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        agent = NodeAgent(f"http://127.0.0.1:{port}", CLUSTER_TOKEN, register_msg("d0", "decode"),
                          protocol.NodeStatus, lambda message: asyncio.sleep(0))
        with pytest.raises(RegistrationRefused, match="could not prove it holds the cluster token"):
            await asyncio.wait_for(agent.run(), 10.0)
    assert len(impostor.frames) == 1
    hello = protocol.LinkHello.model_validate_json(impostor.frames[0])
    assert hello.node_id == "d0"
    assert CLUSTER_TOKEN not in impostor.frames[0]
    assert not agent.registered.is_set()
