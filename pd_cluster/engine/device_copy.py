"""Host-to-device copies that do not wait for the device.

A copy from pageable host memory runs synchronously: the host waits until the device's stream
reaches it, so with a step still running it waits for that whole step. Pipelined steps issue
their next step's inputs while the device is busy, so every copy on that path goes through
pinned memory (PyTorch's caching host allocator keeps each block until its copy has run).
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, queued without waiting on a CUDA device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, queued without waiting on it."""
    return to_device(torch.tensor(data, dtype=dtype), device)
