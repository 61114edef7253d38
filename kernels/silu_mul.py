"""SiLU-gated product of the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import (
    cdiv,
    last_dim_contiguous,
    pdl_options,
    pdl_wait,
    require_triton,
    tl,
    triton,
    use_pdl,
    use_triton,
)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    n_cols,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (row, column block). silu(gate) is rounded to the input dtype before the
    # product, as the reference's two separate torch ops do.
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, act * up, mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_mul_ref`."""
    require_triton()
    n_cols = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * n_cols:
        raise ValueError("gate_up's last dimension must be even")
    rows_in = last_dim_contiguous(gate_up.reshape(-1, 2 * n_cols))
    out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    rows_out = out.view(-1, n_cols)
    if rows_in.shape[0] == 0 or n_cols == 0:
        return out
    block = 1024
    pdl = use_pdl(rows_in)
    _silu_mul_kernel[(rows_in.shape[0], cdiv(n_cols, block))](
        rows_in, rows_out, n_cols, rows_in.stride(0), rows_out.stride(0), BLOCK=block, USE_PDL=pdl, num_warps=4,
        **pdl_options(pdl),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`silu_mul_ref`."""
    if use_triton(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)
