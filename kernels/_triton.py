"""Optional Triton import and the rule for when an op runs its Triton kernel.

Triton is a GPU-only extra. Without it, ``triton.jit`` and ``tl.constexpr`` resolve to
stand-ins so the kernel modules still import and their references run; calling a
``*_triton`` launcher then raises.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs run the references.

    class _TritonStandIn:
        """Enough of ``triton`` / ``triton.language`` for kernel definitions to parse."""

        constexpr = Any

        @staticmethod
        def jit(fn: Callable | None = None, **_: Any) -> Callable:
            return fn if fn is not None else (lambda f: f)

    triton = tl = _TritonStandIn()  # type: ignore[assignment]
    HAS_TRITON = False


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when Triton is importable and every tensor lives on a CUDA device."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def use_triton_kv(quant: str | None, *tensors: torch.Tensor) -> bool:
    """:func:`use_triton` for kernels over a KV cache of kind ``quant`` (None: the model dtype);
    float8 e4m3 codes also need a GPU that converts them (compute capability 8.9 or above, else
    the torch path, which syncs with the host: no CUDA graphs)."""
    if not use_triton(*tensors):
        return False
    if quant != "fp8_e4m3":
        return True
    return _capability(device_index(tensors[0].device)) >= (8, 9)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; install the 'gpu' extra or call the *_ref function")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has stride 1 (what the kernels index by), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """Float32 inputs get three tf32 products per dot (float32 accuracy on the tensor cores; plain
    "ieee" dots spill heavily on Hopper); half-precision inputs use the tensor cores as they are."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


#: Programmatic dependent launch: on Hopper and newer GPUs a kernel of a decode step starts while
#: the one before it still runs and waits (``griddepcontrol.wait``) only where it first touches
#: what that one wrote, hiding a launch's latency, about half of each short kernel's time.
#: ``PD_CLUSTER_PDL=0`` turns it off (to measure it, or on a driver that mishandles it).
_pdl_enabled = os.environ.get("PD_CLUSTER_PDL", "1") != "0"

#: Triton decides at import whether kernels are interpreted; an interpreted kernel has no launch
#: options, so the flag is read once here rather than on every launch.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: The same for jitted code: interpreted kernels take portable paths where compiled ones use PTX.
INTERPRETED = tl.constexpr(_INTERPRETED) if HAS_TRITON else _INTERPRETED


def set_pdl(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for later launches (and graph captures)."""
    global _pdl_enabled
    _pdl_enabled = enabled


def device_index(device: torch.device) -> int:
    """A CUDA device's index; the current device where ``device`` names none (``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, read once a device."""
    return _capability(device_index(device))


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(index: int) -> int | None:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def shared_memory_limit(device: torch.device) -> int | None:
    """The shared memory one program may take on a CUDA device (opted in), read once a device;
    None where torch does not say."""
    return _shared_memory_limit(device_index(device))


def _compute_capability(index: int) -> int:
    return _capability(index)[0]


def use_pdl(t: torch.Tensor) -> bool:
    """True when kernels on ``t``'s device launch as programmatic dependents (compiled Triton on a
    GPU of compute capability 9 or above)."""
    if not (_pdl_enabled and HAS_TRITON and t.is_cuda) or _INTERPRETED:
        return False
    return _compute_capability(device_index(t.device)) >= 9


def pdl_options(enabled: bool) -> dict[str, Any]:
    """Launch options of a kernel whose ``USE_PDL`` is ``enabled``."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Let the next kernel start, then wait until the previous one has finished and its writes
    are visible. Called before a kernel's first read of anything but weights, and before any store."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
