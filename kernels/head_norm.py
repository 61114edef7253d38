"""RMSNorm of each attention head over its ``head_dim`` values (Qwen3's q_norm and k_norm).

The heads are strided views of the qkv projection (``[T, H, D]``, token stride the whole qkv
row). The row norm would need them copied contiguous first and then runs one short row a
program; here a program normalizes a block of (token, head) rows read straight from the view, so
a 4096-token prompt's 131k query heads take one pass over their bytes.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, next_pow2, pdl_options, pdl_wait, require_triton, tl, triton, use_pdl, use_triton
from kernels.rms_norm import rms_norm_ref


def head_rms_norm_ref(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[T, H, D]`` -> each head normalized over ``D`` times ``weight`` ``[D]``, contiguous."""
    shape = heads.shape
    out, _ = rms_norm_ref(heads.reshape(-1, shape[-1]), weight, eps)
    return out.view(shape)


@triton.jit
def _head_rms_norm_kernel(x_ptr, w_ptr, out_ptr, num_rows, num_heads, stride_t, stride_h, eps,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    # ROWS (token, head) rows a program; the roundings of the row norm's kernel (the normalized
    # value in the input dtype before the weight) so that the two agree to the last bit.
    pdl_wait(USE_PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    rmask = r < num_rows
    mask = rmask[:, None] & (d < D)[None, :]
    r64 = r.to(tl.int64)
    src = (r64 // num_heads) * stride_t + (r64 % num_heads) * stride_h
    x = tl.load(x_ptr + src[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) / D
    normed = (x * tl.rsqrt(var + eps)[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + r64[:, None] * D + d[None, :], normed * w[None, :], mask=mask)


def head_rms_norm_triton(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`head_rms_norm_ref` in one launch over the (possibly strided) heads."""
    require_triton()
    tokens, num_heads, dim = heads.shape
    if heads.stride(-1) != 1:
        heads = heads.contiguous()
    weight = weight.contiguous()
    out = torch.empty(heads.shape, dtype=torch.promote_types(heads.dtype, weight.dtype), device=heads.device)
    rows = tokens * num_heads
    if rows == 0:
        return out
    block_d = next_pow2(dim)
    per_program = max(1, min(64, 8192 // block_d))
    pdl = use_pdl(heads)
    _head_rms_norm_kernel[(cdiv(rows, per_program),)](
        heads, weight, out, rows, num_heads, heads.stride(0), heads.stride(1), eps, D=dim, BLOCK_D=block_d,
        ROWS=per_program, USE_PDL=pdl, num_warps=4, **pdl_options(pdl))
    return out


def head_rms_norm(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`head_rms_norm_ref`."""
    if use_triton(heads):
        return head_rms_norm_triton(heads, weight, eps)
    return head_rms_norm_ref(heads, weight, eps)
