"""Direct access to a decode node's KV pools from a prefill node on the same host.

When P and D run on one host (one GPU, or several GPUs of one machine), D hands P handles to
its key and value caches inside the authenticated handshake: one pool a rank, each naming the
KV heads it holds (``first_head`` and its caches' head count; a tensor-parallel D's ranks hold
one part each). P opens them once per channel and writes a prompt's missing KV straight into
the slots D reserved for it, each rank's heads into that rank's pool: no staging buffer, no
network, one kernel launch a pool. Then P commits over the channel's control connection as usual.

A handle names its *kind*: ``cuda`` (CUDA IPC memory handles, opened with torch's own IPC
rebuild) is built in and offered; ``shm`` (a CPU pool moved into the host's shared memory, as
torch shares CPU tensors between processes) is built in but offered only once
:func:`offer_kind` turns it on, which is how CPU tests run the in-place path, also into the
ranks of a tensor-parallel D (their own processes). Other kinds can be registered
(:func:`register_kind`). A handle carries no code: plain ints and bytes, never a pickle.
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
    shm_manager: str = Field(default="", max_length=4096, description="kind shm: the shared memory's manager")


class KVPoolHandle(BaseModel):
    """One rank's key and value caches (``[L, S, Hkv, D]`` each), shareable with a P on its host:
    KV heads ``[first_head, first_head + Hkv)`` of the model."""

    kind: str = Field(min_length=1, max_length=32)
    device_uuid: str | None = Field(default=None, description="the GPU the caches live on")
    first_head: int = Field(default=0, ge=0, description="the first KV head of the model these caches hold")
    k_cache: TensorHandle
    v_cache: TensorHandle

    @property
    def num_heads(self) -> int:
        """KV heads the caches hold (0 when they are not ``[L, S, Hkv, D]``)."""
        return self.k_cache.size[2] if len(self.k_cache.size) == 4 else 0


@dataclass
class SharedPool:
    """One rank's caches as P sees them after opening a :class:`KVPoolHandle`: KV heads
    ``[first_head, first_head + num_heads)``."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    first_head: int = 0

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def num_heads(self) -> int:
        return int(self.k_cache.shape[2])

    @property
    def heads(self) -> slice:
        return slice(self.first_head, self.first_head + self.num_heads)


def missing_heads(first_heads: list[tuple[int, int]], num_kv_heads: int) -> str | None:
    """Why pools holding heads ``[first, first + count)`` each do not hold every one of
    ``num_kv_heads`` heads (None: they do; a head may be held by several, as replicas)."""
    held = [False] * num_kv_heads
    for first, count in first_heads:
        if first + count > num_kv_heads:
            return f"a pool holds heads [{first}, {first + count}) of {num_kv_heads}"
        held[first : first + count] = [True] * count
    lacking = [head for head, ok in enumerate(held) if not ok]
    return f"no pool holds KV heads {lacking}" if lacking else None


Exporter = Callable[[torch.Tensor, torch.Tensor], KVPoolHandle]
Opener = Callable[[KVPoolHandle], SharedPool]
#: A node's pools for a peer that opens the given kinds: one handle a rank, in rank order, or
#: none when some rank's pool cannot be offered in any of them.
PoolOffer = Callable[[list[str]], list[KVPoolHandle]]
_KINDS: dict[str, tuple[Exporter, Opener, str]] = {}
#: Kinds this process offers: it opens them for peers and asks its own ranks for them.
_OFFERED: set[str] = set()


def register_kind(kind: str, device_type: str, exporter: Exporter, opener: Opener, offered: bool = True) -> None:
    """Make ``kind`` of handle exportable for pools on ``device_type`` and (``offered``) openable by peers."""
    _KINDS[kind] = (exporter, opener, device_type)
    offer_kind(kind, offered)


def unregister_kind(kind: str) -> None:
    _KINDS.pop(kind, None)
    _OFFERED.discard(kind)


def offer_kind(kind: str, offered: bool = True) -> None:
    """Whether this process names ``kind`` among the kinds it opens (a registered kind is
    exported on request whether or not it is offered)."""
    if offered:
        _OFFERED.add(kind)
    else:
        _OFFERED.discard(kind)


def openable_kinds(device: torch.device) -> list[str]:
    """Kinds of handle this process offers to open for a node on ``device``."""
    return [kind for kind, (_, _, device_type) in _KINDS.items() if device_type == device.type and kind in _OFFERED]


def export_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, peer_kinds: list[str],
                first_head: int = 0) -> KVPoolHandle | None:
    """Handles to the caches (KV heads from ``first_head`` on) in a kind the peer can open, or
    None when there is none."""
    for kind in peer_kinds:
        entry = _KINDS.get(kind)
        if entry is not None and entry[2] == k_cache.device.type:
            return entry[0](k_cache, v_cache).model_copy(update={"first_head": first_head})
    return None


def one_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> PoolOffer:
    """The offer of a node whose one pool holds every head (TP 1)."""

    def offer(peer_kinds: list[str]) -> list[KVPoolHandle]:
        handle = export_pool(k_cache, v_cache, peer_kinds)
        return [handle] if handle is not None else []

    return offer


def open_pool(handle: KVPoolHandle) -> SharedPool:
    """Open one of D's pools; raises ValueError for an unknown kind, RuntimeError when it fails."""
    entry = _KINDS.get(handle.kind)
    if entry is None:
        raise ValueError(f"unknown KV pool handle kind {handle.kind!r}")
    pool = entry[1](handle)
    pool.first_head = handle.first_head
    return pool


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


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _open_cuda_tensor(h: TensorHandle, device_index: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = _dtype(h.dtype)
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


# ---- host shared memory (CPU) -------------------------------------------------------------------


def _export_shm_tensor(t: torch.Tensor) -> TensorHandle:
    """Move ``t``'s storage into the host's shared memory (in place: every view of it follows,
    its data copied once) and name it as torch's ``file_system`` sharing does."""
    manager, name, size = t.untyped_storage()._share_filename_cpu_()
    return TensorHandle(size=list(t.shape), stride=list(t.stride()), storage_offset=t.storage_offset(),
                        dtype=str(t.dtype).removeprefix("torch."), device_index=0, handle=_b64(name),
                        storage_bytes=size, storage_offset_bytes=0, shm_manager=_b64(manager))


def _open_shm_tensor(h: TensorHandle) -> torch.Tensor:
    name, manager = _unb64(h.handle), _unb64(h.shm_manager)
    if name is None or manager is None:
        raise ValueError("a shared-memory handle without a name")
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, h.storage_bytes)
    return torch.empty(0, dtype=_dtype(h.dtype)).set_(storage, h.storage_offset, h.size, h.stride)


def _export_shm(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVPoolHandle:
    return KVPoolHandle(kind="shm", k_cache=_export_shm_tensor(k_cache), v_cache=_export_shm_tensor(v_cache))


def _open_shm(handle: KVPoolHandle) -> SharedPool:
    return SharedPool(_open_shm_tensor(handle.k_cache), _open_shm_tensor(handle.v_cache))


register_kind("shm", "cpu", _export_shm, _open_shm, offered=False)
