"""The master's half of the proof of the cluster token on a node's websocket.

The node sends :class:`~pd_cluster.protocol.LinkHello`; the master answers with its own proof
(a node checks it before it proves anything, so the node never talks to an impostor master),
then checks the node's :class:`~pd_cluster.protocol.LinkProof`. The token never crosses the
link, and no proof is logged.
"""

from __future__ import annotations

import contextlib
import logging

from pydantic import SecretStr, ValidationError
from starlette.websockets import WebSocket

from master.registry import CLOSE_POLICY_VIOLATION
from pd_cluster import protocol
from pd_cluster.aio import wait_for
from pd_cluster.cluster_proof import new_nonce

logger = logging.getLogger(__name__)

#: Longest wait for the close frame to go out to a refused node.
_CLOSE_GRACE_S = 2.0


async def _receive_text(ws: WebSocket, timeout: float) -> str | bytes | None:
    message = await wait_for(ws.receive(), timeout)
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    return text if text is not None else message.get("bytes", b"")


async def _refuse(ws: WebSocket, reason: str) -> None:
    with contextlib.suppress(Exception):
        await wait_for(ws.send_text(protocol.encode(protocol.Refused(reason=reason))), _CLOSE_GRACE_S)
        await wait_for(ws.close(CLOSE_POLICY_VIOLATION, reason[:120]), _CLOSE_GRACE_S)


async def authenticate_node(ws: WebSocket, token: SecretStr | None, master_id: str, timeout: float) -> str | None:
    """The node id a freshly accepted socket proved the cluster token for, or None once the node
    was refused (logged, the socket closed) or went away."""
    if token is None or not token.get_secret_value():  # create_app refuses to start so
        await _refuse(ws, "unauthorized")
        return None
    try:
        frame = await _receive_text(ws, timeout)
        if frame is None:
            return None
        hello = protocol.LinkHello.model_validate_json(frame)
    except ValidationError:
        logger.warning("refused a node connection from %s: its first frame was no link.hello (a node of an "
                       "older version?)", ws.client)
        await _refuse(ws, "unauthorized: the first frame must be link.hello (this master runs a newer version)")
        return None
    except Exception:  # timed out or the socket broke: nothing was proven
        logger.warning("no link.hello from %s within %.1fs; closing", ws.client, timeout)
        await _refuse(ws, "no link.hello")
        return None
    nonce = new_nonce()
    proofs = protocol.link_transcript(hello, master_id, nonce)
    secret = token.get_secret_value()
    try:
        await wait_for(ws.send_text(protocol.encode(protocol.LinkChallenge(
            master_id=master_id, nonce=nonce, proof=proofs.prove(secret, "listener")))), timeout)
        frame = await _receive_text(ws, timeout)
        if frame is None:  # the node did not accept our proof, or left
            logger.info("node %s (%s) left before proving the cluster token", hello.node_id, ws.client)
            return None
        proof = protocol.LinkProof.model_validate_json(frame)
    except Exception:
        proof = None
    if proof is None or not proofs.verify(secret, "dialer", proof.proof):
        logger.warning("refused a node connection from %s (node %s): it could not prove the cluster token",
                       ws.client, hello.node_id)
        with contextlib.suppress(Exception):
            await wait_for(ws.close(CLOSE_POLICY_VIOLATION, "unauthorized"), _CLOSE_GRACE_S)
        return None
    return hello.node_id
