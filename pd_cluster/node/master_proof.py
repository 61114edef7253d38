"""The node's half of the proof of the cluster token on its link to a master.

The node sends its id and a nonce, checks the master's proof, and only then sends its own: a
process that took over a master's address (or a master of another cluster) gets no proof it
could use and never the token. Any websocket client connection with ``send`` and ``recv`` will do.
"""

from __future__ import annotations

from typing import Any

from pd_cluster import protocol
from pd_cluster.aio import wait_for
from pd_cluster.cluster_proof import new_nonce


class MasterRefusedProof(Exception):
    """The master refused the link, or could not prove it holds the cluster token."""


async def prove_to_master(ws: Any, token: str, node_id: str, timeout: float = 10.0) -> str:
    """Run the exchange on a fresh link; the master's id once both ends proved themselves.

    Raises :class:`MasterRefusedProof` when the master refused or failed its proof (the node's
    proof is then never sent), :class:`TimeoutError` when it did not answer in time.
    """
    hello = protocol.LinkHello(node_id=node_id, nonce=new_nonce())
    await ws.send(protocol.encode(hello))
    frame = await wait_for(ws.recv(), timeout)
    try:
        challenge = protocol.LinkChallenge.model_validate_json(frame)
    except ValueError:
        try:
            refused = protocol.parse_master_message(frame)
        except ValueError:
            refused = None
        if isinstance(refused, protocol.Refused):
            raise MasterRefusedProof(refused.reason) from None
        raise MasterRefusedProof("the master did not answer with a challenge") from None
    proofs = protocol.link_transcript(hello, challenge.master_id, challenge.nonce)
    if not proofs.verify(token, "listener", challenge.proof):
        raise MasterRefusedProof(f"the master (calling itself {challenge.master_id!r}) could not prove it holds "
                                 "the cluster token: it is not a master of this cluster, or their tokens differ")
    await ws.send(protocol.encode(protocol.LinkProof(proof=proofs.prove(token, "dialer"))))
    return challenge.master_id
