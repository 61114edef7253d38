"""Proof of the cluster token without sending it: an HMAC challenge-response, both ways.

Each end of a link sends a fresh random nonce; each then proves it holds the token with
HMAC-SHA256 (key: the token) over a domain label, the link's name, which end it is, both node
ids and both nonces. The dialer checks the listener's proof before it sends its own (or
anything else), so a process that took over a peer's old address learns neither the token nor
a proof it could use: every proof names both nonces (no replay on another connection) and the
side that made it (a listener's proof is never a dialer's, so no reflection).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

#: Bytes of randomness in a nonce (sent as hex).
NONCE_BYTES = 32
#: A nonce or a proof on the wire: 64 lowercase hex digits.
HEX_256 = r"^[0-9a-f]{64}$"
_DOMAIN = "pd-cluster cluster-token proof v1"

#: Fields of the handshake messages: a node id, a nonce, a proof (never shown in a repr).
NodeId = Annotated[str, Field(min_length=1, max_length=128)]
Nonce = Annotated[str, Field(pattern=HEX_256)]
Proof = Annotated[str, Field(pattern=HEX_256, repr=False)]

Link = Literal["data-plane", "master-link"]
Side = Literal["dialer", "listener"]


def new_nonce() -> str:
    """A fresh nonce for one handshake."""
    return secrets.token_hex(NONCE_BYTES)


@dataclass(frozen=True)
class Transcript:
    """What one handshake's proofs are bound to."""

    link: Link
    dialer_id: str
    listener_id: str
    dialer_nonce: str
    listener_nonce: str

    def _message(self, side: Side) -> bytes:
        # A JSON list: no two different transcripts encode to the same bytes.
        return json.dumps([_DOMAIN, self.link, side, self.dialer_id, self.listener_id, self.dialer_nonce,
                           self.listener_nonce]).encode()

    def prove(self, token: str, side: Side) -> str:
        """``side``'s proof that it holds ``token`` (hex)."""
        return hmac.new(token.encode(), self._message(side), hashlib.sha256).hexdigest()

    def verify(self, token: str, side: Side, proof: str) -> bool:
        """Whether ``proof`` is ``side``'s proof over this transcript (constant time); never for a
        transcript whose two nonces are one (a peer echoing ours)."""
        if self.dialer_nonce == self.listener_nonce:
            return False
        return hmac.compare_digest(self.prove(token, side).encode(), proof.encode())
