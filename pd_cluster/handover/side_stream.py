"""The side CUDA stream a prefill node copies KV out of its pool on, as layers are stored.

Copies queued there run at high priority beside the prefill's compute stream (queued behind a
long prefill's kernels at equal priority, they would start only at its end); each waits only for
the store of its own layer. On a CPU there is no side stream and everything runs in order.
"""

from __future__ import annotations

import contextlib

import torch

#: The event after which a queued copy is complete (None on a CPU: it already is).
ReadyEvent = torch.cuda.Event | None


def on_side(side: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Make ``side`` the current stream (nothing on a CPU)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def after_compute(side: torch.cuda.Stream | None) -> None:
    """Order what is queued on ``side`` next after what the current stream has queued so far
    (the layer just stored)."""
    if side is not None:
        stored = torch.cuda.Event()
        stored.record()
        side.wait_event(stored)
