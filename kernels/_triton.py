"""Optional Triton import and the rule for when an op runs its Triton kernel.

Triton is a GPU-only extra. Without it, ``triton.jit`` and ``tl.constexpr`` resolve to
stand-ins so the kernel modules still import and their references run; calling a
``*_triton`` launcher then raises.
"""

from __future__ import annotations

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
