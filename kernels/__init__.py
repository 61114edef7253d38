"""Ops the model calls.

Each op has a pure-torch reference (``*_ref``) and a Triton version (``*_triton``) with the
same signature; the public names below run the Triton version on CUDA tensors when Triton is
installed, and the reference otherwise. Tensors follow the engine's layout:
token-major activations ``[T, heads, head_dim]`` and one KV cache per layer shaped
``[num_slots, kv_heads, head_dim]``, addressed through slot tables.

The names load on first use (:pep:`562`), so a process that only needs a torch-free part
(:mod:`kernels.kv_rows`, which the wire protocol's KV spec reads) does not import torch and
Triton with the package.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: Each public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "apply_rotary": "kernels.rotary",
    "argmax_rows": "kernels.argmax",
    "choose_ids": "kernels.argmax",
    "context_attention": "kernels.attention",
    "convert_kv": "kernels.kv_transfer",
    "copy_kv_slots": "kernels.kv_transfer",
    "decode_attention": "kernels.attention",
    "decode_attention_codes": "kernels.attention",
    "embed_step_inputs": "kernels.step_inputs",
    "gather_kv": "kernels.kv_transfer",
    "head_rms_norm": "kernels.head_norm",
    "linear": "kernels.gemv",
    "norm_linear": "kernels.gemv",
    "norm_qkv_rotary": "kernels.qkv_rotary",
    "rms_norm": "kernels.rms_norm",
    "rotary_cos_sin": "kernels.rotary",
    "rotary_store_kv": "kernels.rotary",
    "scatter_kv": "kernels.kv_transfer",
    "silu_linear": "kernels.gemv",
    "silu_mul": "kernels.silu_mul",
    "store_kv": "kernels.store_kv",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Three ops share their module's name (``rms_norm``, ``silu_mul``, ``store_kv``): importing
    such a module binds it on the package, and ``kernels.store_kv`` must stay the op."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
