"""Each row's argmax of a few rows of logits, in two short launches.

A greedy decode step ends with the argmax of its logits. torch reduces a row of a small batch in
one block, which walks the whole vocabulary by itself: 13 us a step for the default model's
49,152 logits on an H100, as long as three of its layers' projections. Here many programs each
take a slice of a row and a second launch picks among their winners; both wait on the kernel
before them as dependent launches. The result is torch's: the first index of the row's largest
value, a NaN winning over every number (torch ranks it above +inf too; here the two tie).
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, next_pow2, pdl_options, pdl_wait, require_triton, tl, triton, use_pdl, use_triton

#: Logits one program of the first launch reads.
SLICE = 2048


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


@triton.jit
def _slice_argmax_kernel(
    x_ptr, best_ptr, where_ptr, N, stride_x, num_slices,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # a NaN wins over every finite value, as in torch
    best = tl.max(x, axis=0)
    where = tl.min(tl.where(ok & (x == best), offs, N), axis=0)
    tl.store(best_ptr + row * num_slices + part, best)
    tl.store(where_ptr + row * num_slices + part, where)


@triton.jit
def _pick_argmax_kernel(
    best_ptr, where_ptr, out_ptr, N, num_slices,
    BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < num_slices
    pdl_wait(USE_PDL)
    best = tl.load(best_ptr + row * num_slices + p, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + row * num_slices + p, mask=ok, other=N)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (best == top), where, N), axis=0).to(tl.int64))


def argmax_rows_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`argmax_rows_ref` for a 2-D tensor whose rows are contiguous."""
    require_triton()
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected rows of contiguous values, got shape {tuple(x.shape)} strides {x.stride()}")
    rows, n = x.shape
    out = _out_for(x, out)
    if rows == 0:
        return out
    if n == 0:
        raise ValueError("argmax of empty rows")
    slices = cdiv(n, SLICE)
    best = torch.empty((rows, slices), dtype=torch.float32, device=x.device)
    where = torch.empty((rows, slices), dtype=torch.int32, device=x.device)
    pdl = use_pdl(x)
    _slice_argmax_kernel[(rows, slices)](x, best, where, n, x.stride(0), slices, BLOCK=SLICE, USE_PDL=pdl,
                                         num_warps=4, **pdl_options(pdl))
    _pick_argmax_kernel[(rows,)](best, where, out, n, slices, BLOCK_P=max(16, next_pow2(slices)), USE_PDL=pdl,
                                 num_warps=1, **pdl_options(pdl))
    return out


def _out_for(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if out.shape != (x.shape[0],) or out.dtype != torch.int64 or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 vector of {x.shape[0]} on {x.device}")
    return out


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (Triton on CUDA where rows are contiguous, torch elsewhere); ``out``: an
    int64 vector to write them to (a buffer at a fixed address, as a captured step's is)."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        return argmax_rows_triton(x, out)
    if out is None:
        return argmax_rows_ref(x)
    return _out_for(x, out).copy_(argmax_rows_ref(x))
