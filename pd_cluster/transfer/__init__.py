"""Data plane between prefill and decode nodes: framed, authenticated control connections plus a
pairwise tensor channel (NCCL between GPUs, gloo on CPU), and on one host direct access to D's
KV pool (:mod:`.ipc`: CUDA IPC handles exchanged in the handshake). Generic: the nodes define what the
messages mean by subclassing :class:`DataMessage`.
"""

from pd_cluster.transfer.channel import TensorChannel
from pd_cluster.transfer.channel_pool import ChannelPool
from pd_cluster.transfer.client import PeerChannel, dial
from pd_cluster.transfer.errors import (
    ChannelError,
    ConnectionClosed,
    FrameError,
    FrameTooLarge,
    HandshakeRefused,
    RemoteError,
    TransferError,
)
from pd_cluster.transfer.framing import MAX_FRAME_BYTES, DataMessage, ErrorReply
from pd_cluster.transfer.ipc import KVPoolHandle, SharedPool, decode_slots, encode_slots
from pd_cluster.transfer.keeper import ChannelKeeper
from pd_cluster.transfer.server import DataPlaneServer, Handler, PeerConnection

__all__ = [
    "MAX_FRAME_BYTES",
    "ChannelError",
    "ChannelKeeper",
    "ChannelPool",
    "ConnectionClosed",
    "DataMessage",
    "DataPlaneServer",
    "ErrorReply",
    "FrameError",
    "FrameTooLarge",
    "Handler",
    "HandshakeRefused",
    "KVPoolHandle",
    "PeerChannel",
    "PeerConnection",
    "RemoteError",
    "SharedPool",
    "TensorChannel",
    "TransferError",
    "decode_slots",
    "dial",
    "encode_slots",
]
