"""Ops the model calls.

Each op has a pure-torch reference (``*_ref``) and a Triton version (``*_triton``) with the
same signature; the public names below run the Triton version on CUDA tensors when Triton is
installed, and the reference otherwise. Tensors follow the engine's layout:
token-major activations ``[T, heads, head_dim]`` and one KV cache per layer shaped
``[num_slots, kv_heads, head_dim]``, addressed through slot tables.
"""

from kernels.argmax import argmax_rows, choose_ids
from kernels.attention import context_attention, decode_attention
from kernels.gemv import linear, norm_linear, silu_linear
from kernels.head_norm import head_rms_norm
from kernels.kv_transfer import convert_kv, copy_kv_slots, gather_kv, scatter_kv
from kernels.qkv_rotary import norm_qkv_rotary
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary, rotary_cos_sin, rotary_store_kv
from kernels.silu_mul import silu_mul
from kernels.step_inputs import embed_step_inputs
from kernels.store_kv import store_kv

__all__ = [
    "apply_rotary",
    "argmax_rows",
    "choose_ids",
    "context_attention",
    "convert_kv",
    "copy_kv_slots",
    "decode_attention",
    "embed_step_inputs",
    "gather_kv",
    "head_rms_norm",
    "linear",
    "norm_linear",
    "norm_qkv_rotary",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_store_kv",
    "scatter_kv",
    "silu_linear",
    "silu_mul",
    "store_kv",
]
