"""The first exchanges on a data-plane connection: who dials, is it allowed, can the KV move.

P sends :class:`Hello`; D answers :class:`Welcome` (with what P needs to join the pairwise
process group) or :class:`Refused` and closes. The token is compared in constant time and never
appears in a repr, a log line or an error message.

Once the group is formed, P may warm it: :class:`WarmUp` announces one block of KV-shaped
zeros that follows through the tensor channel, and D answers :class:`WarmAck`. That moves real
bytes of the KV's dtype through the pair (on NCCL the first send/recv sets up the communicator's
connections), so the first request's KV push pays no setup. Warm-up bytes are not counted as
KV bytes.
"""

from __future__ import annotations

import hmac
from typing import Literal

import torch
from pydantic import Field, SecretStr, field_serializer

from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer.framing import DataMessage
from pd_cluster.transfer.ipc import KVPoolHandle

#: Bumped when the handshake or the frame layout changes incompatibly.
PROTOCOL_VERSION = 1
#: Largest warm-up tensor D accepts (one block of a large model's KV is a few MiB).
MAX_WARM_UP_BYTES = 64 * 2**20

Backend = Literal["gloo", "nccl"]
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


class Hello(DataMessage):
    """P -> D, first frame: credentials and what P's KV looks like."""

    type: Literal["dp.hello"] = "dp.hello"
    version: int = PROTOCOL_VERSION
    token: SecretStr
    node_id: str = Field(min_length=1, max_length=128)
    kv_spec: KVSpec
    device_type: str
    device_uuid: str | None = Field(default=None, description="GPU identity, to spot two ends on one GPU")
    host_id: str | None = Field(default=None, max_length=512, description="host identity, to spot two ends on one host")
    kv_ipc_kinds: list[str] = Field(default_factory=list, max_length=8,
                                    description="kinds of KV pool handle P can open (transfer.ipc)")

    @field_serializer("token", when_used="json")
    def _reveal_token(self, token: SecretStr) -> str:
        return token.get_secret_value()


class Welcome(DataMessage):
    """D -> P: accepted; join D's private store at ``store_port`` as rank 1 of 2."""

    type: Literal["dp.welcome"] = "dp.welcome"
    node_id: str
    backend: Backend
    store_port: int = Field(gt=0, lt=65536)
    group_timeout_s: float = Field(gt=0)
    kv_pool: KVPoolHandle | None = Field(default=None, description="D's caches, for a P on its host to write into")


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


def check_hello(hello: Hello, token: str, kv_spec: KVSpec, device_type: str) -> str | None:
    """Why D must refuse this Hello, or None to accept. Values read "dialer's != ours"."""
    # Authentication first: an unauthenticated peer learns nothing about this node.
    if not hmac.compare_digest(hello.token.get_secret_value().encode(), token.encode()):
        return "authentication failed"
    if hello.version != PROTOCOL_VERSION:
        return f"protocol version mismatch: {hello.version} != {PROTOCOL_VERSION}"
    if hello.device_type != device_type:
        return f"device type mismatch: {hello.device_type} != {device_type}"
    fields = kv_spec.mismatch(hello.kv_spec)
    if fields:
        details = ", ".join(f"{name} {getattr(hello.kv_spec, name)} != {getattr(kv_spec, name)}" for name in fields)
        return f"KV spec mismatch: {details}"
    return None


def share_pool_with(hello: Hello, host_id: str, local_uuid: str | None, across_gpus: bool) -> bool:
    """Whether D offers its KV pool to this P: same host, a handle kind P can open, and (on
    GPUs) the same GPU unless sharing across the GPUs of a host is enabled."""
    if not hello.kv_ipc_kinds or hello.host_id != host_id:
        return False
    return across_gpus or local_uuid is None or hello.device_uuid == local_uuid


def choose_backend(local: torch.device, local_uuid: str | None, peer_uuid: str | None) -> Backend:
    """NCCL between two GPUs; gloo on CPU, and between two processes sharing one GPU
    (NCCL refuses two ranks on the same device), staged through host memory."""
    if local.type == "cuda" and not (local_uuid is not None and local_uuid == peer_uuid):
        return "nccl"
    return "gloo"
