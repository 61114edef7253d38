"""Direct access to a decode node's KV pool from a prefill node on the same host.

When P and D run on one host (one GPU, or two GPUs of one machine), D hands P handles to its
key and value caches inside the authenticated handshake; P opens them once per channel and
writes a prompt's missing KV straight into the slots D reserved for it: no staging buffer, no
network, one kernel launch. Then P commits over the channel's control connection as usual.

A handle names its *kind*: ``cuda`` (CUDA IPC memory handles, opened with torch's own IPC
rebuild) is built in; other kinds can be registered (:func:`register_kind`), which is how a
CPU test stands in for the GPU path. A handle carries no code: plain ints and bytes, never a
pickle.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)

#: Largest prompt (in slots) whose reserved slot list travels in one MatchResult.
MAX_SLOTS = 1 << 20


class TensorHandle(BaseModel):
    """How to reach one tensor of another process: its storage's IPC handle and its view."""

    size: list[int] = Field(max_length=8)
    stride: list[int] = Field(max_length=8)
    storage_offset: int = Field(ge=0)
    dtype: str
    device_index: int = Field(ge=0)
    handle: str = Field(max_length=4096, description="base64 of the storage's IPC handle")
    storage_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str = Field(default="", max_length=4096)
    ref_counter_offset: int = 0
    event_handle: str = Field(default="", max_length=4096)
    event_sync_required: bool = False


class KVPoolHandle(BaseModel):
    """D's key and value caches (``[L, S, Hkv, D]`` each), shareable with a P on its host."""

    kind: str = Field(min_length=1, max_length=32)
    device_uuid: str | None = Field(default=None, description="the GPU the caches live on")
    k_cache: TensorHandle
    v_cache: TensorHandle


@dataclass
class SharedPool:
    """D's caches as P sees them after opening a :class:`KVPoolHandle`."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.k_cache.device


Exporter = Callable[[torch.Tensor, torch.Tensor], KVPoolHandle]
Opener = Callable[[KVPoolHandle], SharedPool]
_KINDS: dict[str, tuple[Exporter, Opener, str]] = {}


def register_kind(kind: str, device_type: str, exporter: Exporter, opener: Opener) -> None:
    """Make ``kind`` of handle exportable for pools on ``device_type`` and openable by peers."""
    _KINDS[kind] = (exporter, opener, device_type)


def unregister_kind(kind: str) -> None:
    _KINDS.pop(kind, None)


def openable_kinds(device: torch.device) -> list[str]:
    """Kinds of handle this process can open for a node on ``device``."""
    return [kind for kind, (_, _, device_type) in _KINDS.items() if device_type == device.type]


def export_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, peer_kinds: list[str]) -> KVPoolHandle | None:
    """Handles to the caches in a kind the peer can open, or None when there is none."""
    for kind in peer_kinds:
        entry = _KINDS.get(kind)
        if entry is not None and entry[2] == k_cache.device.type:
            return entry[0](k_cache, v_cache)
    return None


def open_pool(handle: KVPoolHandle) -> SharedPool:
    """Open D's caches; raises ValueError for an unknown kind, RuntimeError when it fails."""
    entry = _KINDS.get(handle.kind)
    if entry is None:
        raise ValueError(f"unknown KV pool handle kind {handle.kind!r}")
    return entry[1](handle)


@cache
def host_identity() -> str:
    """Who this host is: its kernel's boot id and its name. Two processes that report the same
    value run on one kernel and can map each other's GPU memory."""
    boot_id = ""
    with contextlib.suppress(OSError):
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot_id}"


def encode_slots(slots: torch.Tensor) -> str:
    """Slot indices as base64 of little-endian int64, for a JSON frame."""
    return base64.b64encode(slots.to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes()).decode()


def decode_slots(text: str) -> torch.Tensor:
    raw = base64.b64decode(text.encode(), validate=True)
    if len(raw) % 8 or len(raw) // 8 > MAX_SLOTS:
        raise ValueError("bad slot list")
    if not raw:  # D holds the whole prompt: nothing to write (frombuffer refuses an empty buffer)
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(raw), dtype=torch.int64)


# ---- CUDA IPC ----------------------------------------------------------------------------------


def _b64(value: bytes | None) -> str:
    return base64.b64encode(value).decode() if value else ""


def _unb64(value: str) -> bytes | None:
    return base64.b64decode(value.encode()) if value else None


def _export_cuda_tensor(t: torch.Tensor) -> TensorHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes, storage_offset_bytes,
     _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return TensorHandle(
        size=list(size), stride=list(stride), storage_offset=offset, dtype=str(dtype).removeprefix("torch."),
        device_index=device, handle=_b64(handle), storage_bytes=storage_bytes,
        storage_offset_bytes=storage_offset_bytes, ref_counter_handle=_b64(ref_handle),
        ref_counter_offset=ref_offset, event_handle=_b64(event_handle), event_sync_required=bool(event_sync),
    )


def _open_cuda_tensor(h: TensorHandle, device_index: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, h.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {h.dtype!r}")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(h.size), tuple(h.stride), h.storage_offset, torch.UntypedStorage, dtype,
        device_index, _unb64(h.handle), h.storage_bytes, h.storage_offset_bytes, False,
        _unb64(h.ref_counter_handle), h.ref_counter_offset, _unb64(h.event_handle), h.event_sync_required,
    )


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpu_index(uuid: str | None) -> int | None:
    """This process's index of the GPU named ``uuid`` (indices differ between processes when
    their visible devices differ), or None when it cannot see that GPU."""
    if uuid is None or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    return None


def _export_cuda(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVPoolHandle:
    return KVPoolHandle(kind="cuda", device_uuid=gpu_uuid(k_cache.device.index or 0),
                        k_cache=_export_cuda_tensor(k_cache), v_cache=_export_cuda_tensor(v_cache))


def _open_cuda(handle: KVPoolHandle) -> SharedPool:
    index = local_gpu_index(handle.device_uuid)
    if index is None:
        raise RuntimeError(f"GPU {handle.device_uuid} is not visible to this process")
    with torch.cuda.device(index):
        return SharedPool(_open_cuda_tensor(handle.k_cache, index), _open_cuda_tensor(handle.v_cache, index))


register_kind("cuda", "cuda", _export_cuda, _open_cuda)
