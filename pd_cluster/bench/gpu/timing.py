"""Clocks: CUDA events for one device's work, the host clock around work on several, and awaits."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cuda_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` between CUDA events on the current stream (host clock on a CPU)."""
    if device.type != "cuda":
        return wall_ms(fn, [device], warmup, reps)
    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], Any], devices: list[torch.device], warmup: int = 1, reps: int = 5) -> float:
    """Median wall milliseconds of ``fn`` (host clock; ``fn`` must leave nothing queued)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        for d in devices:
            sync(d)
        start = time.perf_counter()
        fn()
        for d in devices:
            sync(d)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


async def async_ms(fn: Callable[[], Awaitable[Any]], reps: int = 5, warmup: int = 1) -> float:
    """Median wall milliseconds of awaiting ``fn()``."""
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
