"""Host-to-device copies that do not wait for the device.

A copy from pageable host memory runs synchronously: the host waits until the device's stream
reaches it, so with a step still running it waits for that whole step. Pipelined steps issue
their next step's inputs while the device is busy, so every copy on that path goes through
pinned memory (PyTorch's caching host allocator keeps each block until its copy has run).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, queued without waiting on a CUDA device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, queued without waiting on it."""
    return to_device(torch.tensor(data, dtype=dtype), device)


class PinnedRing:
    """Pinned host buffers that stage a step's small inputs, taken in turn: a buffer is written
    again only once the copy that last read it has run (it almost always has: the ring is deeper
    than the steps in flight), so a step allocates nothing and makes one copy. Elsewhere than on
    a CUDA device (tests of the layouts on CPU) the buffers are plain and copies synchronous."""

    DEPTH = 4
    #: Cached views at most (each holds its destination alive).
    MAX_VIEWS = 64

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._buffers = [torch.zeros(size, dtype=dtype, pin_memory=self._cuda) for _ in range(self.DEPTH)]
        self._arrays = [b.numpy() for b in self._buffers]
        self._copied: list[torch.cuda.Event | None] = [None] * self.DEPTH
        self._next = 0
        self._device = device
        # (buffer, length, destination) -> the two views one copy joins. A step's copy has a
        # length of a few kinds (one a graph shape); slicing anew each time cost two torch ops.
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def stage(self) -> np.ndarray:
        """The next buffer, free to fill (a numpy view of it), for :meth:`copy` to send."""
        done = self._copied[self._next]
        if done is not None:
            done.synchronize()
        return self._arrays[self._next]

    def copy(self, dest: torch.Tensor, n: int) -> None:
        """Queue the copy of the staged buffer's first ``n`` elements to the front of ``dest`` (of
        the same dtype) on the current stream, and move on to the next buffer."""
        i = self._next
        self._next = (i + 1) % self.DEPTH
        key = (i, n, dest.data_ptr())
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self.MAX_VIEWS:
                self._views.clear()
            views = self._views[key] = (dest[:n], self._buffers[i][:n])
        views[0].copy_(views[1], non_blocking=self._cuda)
        if self._cuda:
            event = self._copied[i] = self._copied[i] or torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
