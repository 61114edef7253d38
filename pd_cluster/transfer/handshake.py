"""The first exchanges on a data-plane connection: who dials, do both hold the cluster token, can
the KV move.

P sends :class:`Hello` (its id and a nonce); D answers :class:`Challenge` (its id, its nonce and
its proof of the token, :mod:`pd_cluster.cluster_proof`). P checks D's proof before it sends
anything else, then sends :class:`Join` (its own proof and what its KV looks like); D checks P's
proof and answers :class:`Welcome` (with what P needs to join the pairwise process group) or
:class:`Refused` and closes. The token itself never crosses the wire; proofs are bound to both
nonces, so one recorded on a connection is worthless on another, and to the side that made
it, so D's proof cannot be reflected as P's.

Once the group is formed, P may warm it: :class:`WarmUp` announces one block of KV-shaped
zeros that follows through the tensor channel, and D answers :class:`WarmAck`. That moves real
bytes of the KV's dtype through the pair (on NCCL the first send/recv sets up the communicator's
connections), so the first request's KV push pays no setup. Warm-up bytes are not counted as
KV bytes.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pd_cluster.cluster_proof import NodeId, Nonce, Proof, Transcript
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer.framing import DataMessage
from pd_cluster.transfer.ipc import KVPoolHandle

#: Bumped when the handshake or the frame layout changes incompatibly (2: mutual proof, no token;
#: 3: one KV pool handle a rank of D; 4: D's KV dtype in its answer, which P converts its rows into).
PROTOCOL_VERSION = 4
#: Most KV pools D offers (one a rank).
MAX_POOLS = 64
#: Largest warm-up tensor D accepts (one block of a large model's KV is a few MiB).
MAX_WARM_UP_BYTES = 64 * 2**20
#: Why either side refuses a peer that could not prove it holds the cluster token.
AUTH_FAILED = "authentication failed"

Backend = Literal["gloo", "nccl"]
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


class Hello(DataMessage):
    """P -> D, first frame: who dials, and P's nonce. Nothing an impostor D could use."""

    type: Literal["dp.hello"] = "dp.hello"
    version: int = PROTOCOL_VERSION
    node_id: NodeId
    nonce: Nonce


class Challenge(DataMessage):
    """D -> P: D's id and nonce, and D's proof of the cluster token over both nonces."""

    type: Literal["dp.challenge"] = "dp.challenge"
    node_id: NodeId
    nonce: Nonce
    proof: Proof


class Join(DataMessage):
    """P -> D, once D proved itself: P's proof and what P's KV looks like."""

    type: Literal["dp.join"] = "dp.join"
    proof: Proof
    kv_spec: KVSpec
    device_type: str
    device_uuid: str | None = Field(default=None, description="GPU identity, to spot two ends on one GPU")
    host_id: str | None = Field(default=None, max_length=512, description="host identity, to spot two ends on one host")
    kv_ipc_kinds: list[str] = Field(default_factory=list, max_length=8,
                                    description="kinds of KV pool handle P can open (transfer.ipc)")


def transcript(hello: Hello, listener_id: str, listener_nonce: str) -> Transcript:
    """What both proofs of one handshake are bound to (P dials, D listens)."""
    return Transcript("data-plane", hello.node_id, listener_id, hello.nonce, listener_nonce)


class Welcome(DataMessage):
    """D -> P: accepted; join D's private store at ``store_port`` as rank 1 of 2."""

    type: Literal["dp.welcome"] = "dp.welcome"
    node_id: str
    backend: Backend
    store_port: int = Field(gt=0, lt=65536)
    group_timeout_s: float = Field(gt=0)
    kv_dtype: str = Field(default="", max_length=32,
                          description="what D's KV cache stores (KVSpec.kv_dtype): P sends its KV converted "
                                      "into it (empty: as P's)")
    kv_pools: list[KVPoolHandle] = Field(default_factory=list, max_length=MAX_POOLS,
                                         description="D's caches, one pool a rank with the KV heads it holds, "
                                                     "for a P on its host to write into (empty: none offered)")


class Refused(DataMessage):
    """D -> P: not accepted; D closes the connection after this frame."""

    type: Literal["dp.refused"] = "dp.refused"
    reason: str


class WarmUp(DataMessage):
    """P -> D on a formed channel: a tensor of ``shape`` and ``dtype`` follows; answer WarmAck."""

    type: Literal["dp.warm_up"] = "dp.warm_up"
    shape: list[int] = Field(min_length=1, max_length=8)
    dtype: str


class WarmAck(DataMessage):
    """D -> P: the warm-up tensor arrived; the channel is warm."""

    type: Literal["dp.warm_ack"] = "dp.warm_ack"
    bytes: int = Field(ge=0)


def warm_up_shape(kv_spec: KVSpec) -> list[int]:
    """One block of KV in the layout a push carries: ``[2, layers, block_size, kv_heads, head_dim]``."""
    return [2, kv_spec.num_layers, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim]


def device_identity(device: torch.device) -> tuple[str, str | None]:
    """(device type, GPU uuid or None) of the device a node keeps its KV on."""
    if device.type != "cuda":
        return device.type, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "cuda", str(torch.cuda.get_device_properties(index).uuid)


def check_hello(hello: Hello) -> str | None:
    """Why D must refuse this Hello before proving anything, or None to answer it."""
    if hello.version != PROTOCOL_VERSION:
        return f"protocol version mismatch: {hello.version} != {PROTOCOL_VERSION}"
    return None


def check_join(join: Join, proof_ok: bool, kv_spec: KVSpec, device_type: str) -> str | None:
    """Why D must refuse this Join, or None to accept. Values read "dialer's != ours"."""
    # Authentication first: an unauthenticated peer learns nothing about this node.
    if not proof_ok:
        return AUTH_FAILED
    if join.device_type != device_type:
        return f"device type mismatch: {join.device_type} != {device_type}"
    fields = kv_spec.mismatch(join.kv_spec)
    if fields:
        details = ", ".join(f"{name} {getattr(join.kv_spec, name)} != {getattr(kv_spec, name)}" for name in fields)
        return f"KV spec mismatch: {details}"
    return None


def share_pool_with(join: Join, host_id: str, local_uuid: str | None, across_gpus: bool) -> bool:
    """Whether D offers its KV pool to this P: same host, a handle kind P can open, and (on
    GPUs) the same GPU unless sharing across the GPUs of a host is enabled."""
    if not join.kv_ipc_kinds or join.host_id != host_id:
        return False
    return across_gpus or local_uuid is None or join.device_uuid == local_uuid


def choose_backend(local: torch.device, local_uuid: str | None, peer_uuid: str | None) -> Backend:
    """NCCL between two GPUs; gloo on CPU, and between two processes sharing one GPU
    (NCCL refuses two ranks on the same device), staged through host memory."""
    if local.type == "cuda" and not (local_uuid is not None and local_uuid == peer_uuid):
        return "nccl"
    return "gloo"
