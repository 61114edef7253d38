"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch

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


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm(x + residual) * weight, x + residual)``.

    The second value is the new residual stream; with ``residual=None`` it is ``x``.
    Math runs in float32 and the result is cast back to ``x.dtype``.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    out = (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return out, x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One row per program. Every rounding the reference does (the residual sum in the
    # stream's dtype, the normalised value in that dtype before the weight) is repeated
    # here, so low-precision results match it to the last bit but for the mean's order.
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, normed * w, mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rms_norm_ref` (same signature, same result dtypes)."""
    require_triton()
    n_cols = x.shape[-1]
    x2 = last_dim_contiguous(x.reshape(-1, n_cols))
    weight = weight.contiguous()
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        res2 = last_dim_contiguous(residual.reshape(-1, n_cols))
        new_residual = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    else:
        # Nothing to add: the sum buffer only carries the stream dtype for the rounding step.
        res2, new_residual = x2, x
    sum2 = new_residual.reshape(-1, n_cols) if residual is not None else x2
    rows = x2.shape[0]
    if rows == 0:
        return out, new_residual
    block = next_pow2(n_cols)
    pdl = use_pdl(x2)
    _rms_norm_kernel[(rows,)](
        x2,
        res2,
        weight,
        out2,
        sum2,
        n_cols,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        sum2.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=min(16, max(1, block // 256)),
        **pdl_options(pdl),
    )
    return out, new_residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA tensors when Triton is installed, else :func:`rms_norm_ref`."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
