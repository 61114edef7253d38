"""Each row's argmax of a few rows of logits, in two short launches.

A greedy decode step ends with the argmax of its logits. torch reduces a row of a small batch in
one block, which walks the whole vocabulary by itself: 13 us a step for the default model's
49,152 logits on an H100, as long as three of its layers' projections. Here many programs each
take a slice of a row and a second launch picks among their winners; both wait on the kernel
before them as dependent launches. The result is torch's: the first index of the row's largest
value, a NaN winning over every number (torch ranks it above +inf too; here the two tie).

The second launch can also store the ids into pinned host memory (``host_out``), so a captured
greedy step's ids reach the host with the step itself, with no copy queued behind it.
:func:`choose_ids` ends a captured sampled step the same way: each row takes its argmax or its
draw, and the ids go to the device row the next step reads and to the host row.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, next_pow2, pdl_options, pdl_wait, require_triton, tl, triton, use_pdl, use_triton

#: Logits one program of the first launch reads.
SLICE = 2048


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def store_host_ids(ids: torch.Tensor, host_out: torch.Tensor, host_row: torch.Tensor) -> None:
    """What :func:`argmax_rows` does with ``host_out`` outside the kernel: ``host_out[host_row[0],
    :len(ids)] = ids``."""
    host_out[int(host_row.reshape(-1)[0])][: ids.shape[0]].copy_(ids)


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
    best_ptr, where_ptr, out_ptr, host_ptr, host_row_ptr, N, num_slices, stride_host,
    BLOCK_P: tl.constexpr, HAS_HOST: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < num_slices
    pdl_wait(USE_PDL)
    best = tl.load(best_ptr + row * num_slices + p, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + row * num_slices + p, mask=ok, other=N)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(ok & (best == top), where, N), axis=0).to(tl.int64)
    tl.store(out_ptr + row, winner)
    if HAS_HOST:  # also into mapped host memory: a posted write, nothing waits on it here
        host_row = tl.load(host_row_ptr)
        tl.store(host_ptr + host_row * stride_host + row, winner)


def argmax_rows_triton(x: torch.Tensor, out: torch.Tensor | None = None, host_out: torch.Tensor | None = None,
                       host_row: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`argmax_rows_ref` for a 2-D tensor whose rows are contiguous;
    ``host_out``, ``host_row`` as in :func:`argmax_rows`."""
    require_triton()
    check_host_ids(x, host_out, host_row)
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
    has_host = host_out is not None and host_row is not None
    _pick_argmax_kernel[(rows,)](best, where, out, host_out if has_host else out, host_row if has_host else out, n,
                                 slices, host_out.stride(0) if has_host else 0, BLOCK_P=max(16, next_pow2(slices)),
                                 HAS_HOST=has_host, USE_PDL=pdl, num_warps=1, **pdl_options(pdl))
    return out


def check_host_ids(x: torch.Tensor, host_out: torch.Tensor | None, host_row: torch.Tensor | None) -> None:
    """``host_out`` and ``host_row`` fit the ids of ``x``'s rows (on its device)."""
    if (host_out is None) != (host_row is None):
        raise ValueError("host_out and host_row go together")
    if host_out is None or host_row is None:
        return
    if host_out.dim() != 2 or host_out.dtype != torch.int64 or host_out.stride(-1) != 1:
        raise ValueError("host_out must be a 2-D int64 tensor with contiguous rows")
    if host_out.shape[1] < x.shape[0]:
        raise ValueError(f"host_out rows hold {host_out.shape[1]} ids, the logits have {x.shape[0]} rows")
    if host_row.numel() != 1 or host_row.dtype != torch.int64 or host_row.device != x.device:
        raise ValueError("host_row must be one int64 on the logits' device")
    if x.is_cuda and not host_out.is_pinned():
        raise ValueError("host_out must be pinned host memory for the device to write it")


def _out_for(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if out.shape != (x.shape[0],) or out.dtype != torch.int64 or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 vector of {x.shape[0]} on {x.device}")
    return out


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, host_out: torch.Tensor | None = None,
                host_row: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (Triton on CUDA where rows are contiguous, torch elsewhere); ``out``: an
    int64 vector to write them to (a buffer at a fixed address, as a captured step's is).
    ``host_out`` ``[R, W]`` (pinned host memory where ``x`` is on a GPU) and ``host_row`` (one
    int64 on ``x``'s device, read when the kernel runs): the ids are also stored to
    ``host_out[host_row, :rows]``, by the kernel on a GPU."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        return argmax_rows_triton(x, out, host_out, host_row)
    check_host_ids(x, host_out, host_row)
    ids = argmax_rows_ref(x) if out is None else _out_for(x, out).copy_(argmax_rows_ref(x))
    if host_out is not None and host_row is not None:
        store_host_ids(ids, host_out, host_row)
    return ids


def choose_ids_ref(greedy: torch.Tensor, argmax: torch.Tensor, drawn: torch.Tensor, out: torch.Tensor,
                   host_out: torch.Tensor | None = None, host_row: torch.Tensor | None = None) -> torch.Tensor:
    torch.where(greedy.bool(), argmax, drawn, out=out)
    if host_out is not None and host_row is not None:
        store_host_ids(out, host_out, host_row)
    return out


@triton.jit
def _choose_ids_kernel(
    greedy_ptr, stride_greedy, argmax_ptr, drawn_ptr, out_ptr, host_ptr, host_row_ptr, rows, stride_host,
    BLOCK: tl.constexpr, HAS_HOST: tl.constexpr, USE_PDL: tl.constexpr,
):
    r = tl.arange(0, BLOCK)
    ok = r < rows
    pdl_wait(USE_PDL)
    greedy = tl.load(greedy_ptr + r * stride_greedy, mask=ok, other=0)
    ids = tl.where(greedy != 0, tl.load(argmax_ptr + r, mask=ok, other=0), tl.load(drawn_ptr + r, mask=ok, other=0))
    tl.store(out_ptr + r, ids, mask=ok)
    if HAS_HOST:
        host_row = tl.load(host_row_ptr)
        tl.store(host_ptr + host_row * stride_host + r, ids, mask=ok)


def choose_ids_triton(greedy: torch.Tensor, argmax: torch.Tensor, drawn: torch.Tensor, out: torch.Tensor,
                      host_out: torch.Tensor | None = None, host_row: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`choose_ids_ref`: one program for the batch."""
    require_triton()
    check_host_ids(drawn, host_out, host_row)
    rows = drawn.shape[0]
    for t in (argmax, drawn, out):
        if t.dtype != torch.int64 or t.shape[0] != rows or (rows > 1 and t.stride(0) != 1):
            raise ValueError("argmax, drawn and out must be contiguous int64 vectors of one length")
    if rows == 0:
        return out
    has_host = host_out is not None and host_row is not None
    pdl = use_pdl(drawn)
    _choose_ids_kernel[(1,)](greedy, greedy.stride(0), argmax, drawn, out, host_out if has_host else out,
                             host_row if has_host else out, rows, host_out.stride(0) if has_host else 0,
                             BLOCK=max(16, next_pow2(rows)), HAS_HOST=has_host, USE_PDL=pdl, num_warps=1,
                             **pdl_options(pdl))
    return out


def choose_ids(greedy: torch.Tensor, argmax: torch.Tensor, drawn: torch.Tensor, out: torch.Tensor,
               host_out: torch.Tensor | None = None, host_row: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's id into ``out``: its ``argmax`` where ``greedy`` (a strided int column) is set,
    else its ``drawn`` id; and into ``host_out[host_row[0], :rows]`` as :func:`argmax_rows` does
    (one launch: a captured sampled step ends with it, its ids on the device and the host)."""
    if use_triton(drawn):
        return choose_ids_triton(greedy, argmax, drawn, out, host_out, host_row)
    check_host_ids(drawn, host_out, host_row)
    return choose_ids_ref(greedy, argmax, drawn, out, host_out, host_row)
