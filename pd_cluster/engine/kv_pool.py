"""Token-level KV memory: one slot per token, preallocated, no fragmentation."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kernels.kv_quant import row_scales
from pd_cluster.kv_spec import KVSpec

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "uint8": torch.uint8}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class KVPool:
    """Per-layer key/value tensors ``[num_layers, num_slots, kv_heads, head_dim]`` and a free list.

    Any free slot serves any token, so memory never fragments; a request maps its tokens to
    slots through its own slot list. Freeing a slot that is already free is a bug and raises.

    A quantized pool (``spec.kv_dtype`` int8 or fp8_e4m3) holds rows
    ``[num_layers, num_slots, kv_heads, row_bytes]`` uint8, each with its float32 scale and
    padded to 16 bytes (:mod:`kernels.kv_quant`); :attr:`k_scale` and :attr:`v_scale` view
    those scales. A handover moves each row's first ``spec.row_width`` bytes.
    """

    def __init__(self, spec: KVSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.spec = spec
        self.device = torch.device(device)
        shape = (spec.num_layers, num_slots, spec.num_kv_heads, spec.pool_row_width)
        dtype = torch_dtype(spec.storage_dtype)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._capacity = num_slots
        # Free slots live on the host, in numpy: allocation is bookkeeping, not device work, and a
        # decode step allocates every step (torch's per-op cost was most of a small model's schedule).
        self._free_stack = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._num_free = num_slots
        self._is_free = np.ones(num_slots, dtype=bool)
        #: Holders of each slot beyond its first (beams sharing their prefix): a free by one of
        #: them drops a hold, and the slot returns to the pool with the last.
        self._shared = np.zeros(num_slots, dtype=np.int32)
        #: Calls to :meth:`free` so far: an engine compares it across a step's launch.
        self.frees = 0

    @property
    def quant(self) -> str | None:
        """The quantized KV kind the caches hold (int8, fp8_e4m3), None for the model dtype."""
        return self.spec.kv_dtype if self.spec.quantized else None

    @property
    def k_scale(self) -> torch.Tensor | None:
        """Keys' scales ``[num_layers, num_slots, kv_heads, 1]`` float32 (a view), None unquantized."""
        return row_scales(self.k_cache, self.spec.head_dim) if self.spec.quantized else None

    @property
    def v_scale(self) -> torch.Tensor | None:
        """Values' scales, as :attr:`k_scale`."""
        return row_scales(self.v_cache, self.spec.head_dim) if self.spec.quantized else None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots (int64, CPU), or None when fewer are free."""
        slots = self.take(n)
        return torch.from_numpy(slots) if slots is not None else None

    def take(self, n: int) -> np.ndarray | None:
        """:meth:`alloc` as a numpy array (no torch op: a decode step allocates every step)."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of slots")
        if n > self._num_free:
            return None
        start = self._num_free - n
        slots = self._free_stack[start : self._num_free].copy()
        self._num_free = start
        self._is_free[slots] = False
        return slots

    def reserve(self, n: int) -> torch.Tensor:
        """Take ``n`` slots out of service for good (e.g. the padding rows of CUDA graphs):
        they are never handed out and no longer count in :attr:`capacity`."""
        slots = self.alloc(n)
        if slots is None:
            raise RuntimeError(f"cannot reserve {n} KV slots: only {self._num_free} free")
        self._capacity -= n
        return slots

    def share(self, slots: torch.Tensor) -> None:
        """One more holder of slots in use (a beam forked from the one that wrote them): each
        holder frees them once, and they return to the pool with the last free."""
        held = slots.to(device="cpu", dtype=torch.int64).numpy()
        if self._is_free[held].any():
            raise RuntimeError("cannot share a free KV slot")
        np.add.at(self._shared, held, 1)

    def holders(self, slot: int) -> int:
        """How many hold a slot (0: free)."""
        return 0 if self._is_free[slot] else int(self._shared[slot]) + 1

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the pool; each must be in use, and listed once. A shared slot only
        loses a holder (:meth:`share`)."""
        if slots.numel() == 0:
            return
        self.frees += 1
        freed = slots.to(device="cpu", dtype=torch.int64).numpy()
        if self._is_free[freed].any() or np.unique(freed).size != freed.size:
            raise RuntimeError("KV slot freed twice")
        shared = self._shared[freed] > 0
        if shared.any():
            self._shared[freed[shared]] -= 1
            freed = freed[~shared]
        self._is_free[freed] = True
        end = self._num_free + freed.size
        self._free_stack[self._num_free : end] = freed
        self._num_free = end

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value cache of one layer, ``[num_slots, kv_heads, head_dim]`` each."""
        return self.k_cache[index], self.v_cache[index]
