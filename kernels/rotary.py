"""Rotary position embedding (rotate-half layout, as Llama checkpoints in HF format use)."""

from __future__ import annotations

import math

import torch

from kernels import _tiles
from kernels._triton import (
    last_dim_contiguous,
    next_pow2,
    pdl_options,
    pdl_wait,
    require_triton,
    tl,
    triton,
    use_pdl,
    use_triton,
)
from kernels.store_kv import store_kv, store_kv_ref


#: ``rope_scaling`` types the tables follow (transformers' rope init functions of the same names).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_type(scaling: dict | None) -> str:
    """The scaling's type (``rope_type``, or ``type`` in older configs); "default" without one."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def rotary_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                    max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the factor cos and sin are multiplied by (yarn's attention factor,
    1 otherwise), as transformers computes them for each ``rope_scaling`` type."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "dynamic":
        # Dynamic NTK changes the base only for sequences longer than max_position_embeddings,
        # which the engine never runs (its context is capped there): the default frequencies.
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_positions)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict,
                   max_positions: int | None) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated frequencies below a ramp of dimensions, extrapolated above it, and an
    attention factor on cos and sin (transformers' ``_compute_yarn_parameters``)."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        if max_positions is None:
            raise ValueError("rope_scaling: yarn without a factor needs max_position_embeddings")
        factor = max_positions / original
    factor = float(factor)
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rotary_cos_sin(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``cos, sin`` of shape ``[max_positions, head_dim]`` in float32 (scaled by yarn's
    attention factor where configured, as transformers scales them)."""
    inv_freq, attention_factor = rotary_inv_freq(head_dim, theta, scaling, max_positions)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(device), sin.to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by their positions ``[T]``.

    Returns new tensors of the input dtype; the math runs in float32.
    """
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    qf, kf = q.float(), k.float()
    q_out = qf * c + _rotate_half(qf) * s
    k_out = kf * c + _rotate_half(kf) * s
    return q_out.to(q.dtype), k_out.to(k.dtype)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    pos_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_vot,
    stride_voh,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One token per program: its cos/sin row is loaded once and applied to every q and k head.
    # Both halves of the tables are read (not assumed equal), as the reference does. With
    # STORE_KV the rotated keys, and the values as they are, go straight to the token's KV slot
    # (k_out / v_out are then the caches, addressed by slot).
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c1 = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_sin + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _tiles.rotate_heads(q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, num_q_heads, stride_qh, stride_qoh,
                        d, dmask, c1, c2, s1, s2, HALF, BLOCK_H)
    if STORE_KV:
        row = tl.load(slots_ptr + tok).to(tl.int64)
    else:
        row = tok
    _tiles.rotate_heads(k_ptr + tok * stride_kt, k_out_ptr + row * stride_kot, num_kv_heads, stride_kh, stride_koh,
                        d, dmask, c1, c2, s1, s2, HALF, BLOCK_H)
    if STORE_KV:
        for h0 in range(0, num_kv_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            m = (h < num_kv_heads)[:, None] & dmask[None, :]
            src = v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :]
            dst = v_out_ptr + row * stride_vot + h[:, None] * stride_voh + d[None, :]
            tl.store(dst, tl.load(src, mask=m), mask=m)
            tl.store(dst + HALF, tl.load(src + HALF, mask=m), mask=m)


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`apply_rotary_ref`; q and k may be strided views (a split qkv)."""
    require_triton()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_rotary(q, k, None, positions, None, cos, sin, q_out, k_out, None)
    return q_out, k_out


def rotary_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Triton version of :func:`rotary_store_kv_ref`: one launch instead of two."""
    require_triton()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_rotary(q, k, v, positions, slots, cos, sin, q_out, k_cache, v_cache)
    return q_out


def _launch_rotary(q, k, v, positions, slots, cos, sin, q_out, k_out, v_out) -> None:
    """One program per token; with ``v`` given, keys and values go to ``k_out`` / ``v_out`` (the
    caches) at ``slots``."""
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    cos, sin = last_dim_contiguous(cos), last_dim_contiguous(sin)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError("rotary needs an even head_dim")
    if num_tokens == 0:
        return
    store = v is not None
    if store:
        v = last_dim_contiguous(v)
    else:
        v, v_out, slots = k, k_out, positions  # unused by the kernel
    half = head_dim // 2
    block_half = next_pow2(half)
    block_h = min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, 4096 // block_half))
    pdl = use_pdl(q)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        v,
        q_out,
        k_out,
        v_out,
        positions,
        slots,
        cos,
        sin,
        num_q_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        v_out.stride(0),
        v_out.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        STORE_KV=store,
        USE_PDL=pdl,
        num_warps=4,
        **pdl_options(pdl),
    )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA tensors when Triton is installed, else :func:`apply_rotary_ref`."""
    if use_triton(q, k):
        return apply_rotary_triton(q, k, positions, cos, sin)
    return apply_rotary_ref(q, k, positions, cos, sin)


def rotary_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k by their positions, write the rotated keys and the values into their KV slots
    (:func:`kernels.store_kv.store_kv_ref`) and return the rotated q: what a layer needs before
    attention, which reads keys from the cache."""
    q_out, k_out = apply_rotary_ref(q, k, positions, cos, sin)
    store_kv_ref(k_out, v, k_cache, v_cache, slots)
    return q_out


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    quant: str | None = None,
) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`rotary_store_kv_ref`; into
    quantized caches (``quant``, see :func:`kernels.store_kv.store_kv_ref`) the rotation, then
    the quantizing store."""
    if quant is not None:
        q_out, k_out = apply_rotary(q, k, positions, cos, sin)
        store_kv(k_out, v, k_cache, v_cache, slots, quant)
        return q_out
    if use_triton(q, k, k_cache):
        return rotary_store_kv_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    return rotary_store_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
