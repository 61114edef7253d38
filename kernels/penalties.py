"""Repetition, frequency and presence penalties applied to a batch of logits in one pass.

Each row reads its request's row of two tables (``index[b]``): token counts of its output
(int32) and the set of tokens its prompt and output hold (bool). Repetition is Hugging Face's
(positive logits divided, negative ones multiplied, over the set); frequency and presence are
OpenAI's (``x -= frequency * count + presence * (count > 0)``).
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, require_triton, tl, triton, use_triton


def apply_penalties_ref(
    x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor,
    frequency: torch.Tensor, presence: torch.Tensor, use_repetition: bool = True, use_counts: bool = True,
) -> None:
    """Penalize float32 ``x`` ``[B, V]`` in place; ``index`` ``[B]`` int64 rows of ``counts`` /
    ``seen`` ``[R, V]``; per-row settings ``[B]`` float32 (strided columns are fine)."""
    if use_repetition:
        penalty = repetition.unsqueeze(1)
        torch.where(seen.index_select(0, index), torch.where(x > 0, x / penalty, x * penalty), x, out=x)
    if use_counts:
        c = counts.index_select(0, index).to(torch.float32)
        x -= frequency.unsqueeze(1) * c + presence.unsqueeze(1) * (c > 0).to(torch.float32)


@triton.jit
def _penalties_kernel(
    x_ptr, stride_x, index_ptr, counts_ptr, seen_ptr, vocab, rep_ptr, freq_ptr, pres_ptr, stride_setting,
    USE_REP: tl.constexpr, USE_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    table_row = tl.load(index_ptr + row) * vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=0.0)
    if USE_REP:
        penalty = tl.load(rep_ptr + row * stride_setting)
        hit = tl.load(seen_ptr + table_row + cols, mask=valid, other=0) != 0
        x = tl.where(hit, tl.where(x > 0, x / penalty, x * penalty), x)
    if USE_COUNTS:
        c = tl.load(counts_ptr + table_row + cols, mask=valid, other=0).to(tl.float32)
        frequency = tl.load(freq_ptr + row * stride_setting)
        presence = tl.load(pres_ptr + row * stride_setting)
        x = x - (frequency * c + presence * (c > 0).to(tl.float32))
    tl.store(x_ptr + row.to(tl.int64) * stride_x + cols, x, mask=valid)


def apply_penalties_triton(
    x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor,
    frequency: torch.Tensor, presence: torch.Tensor, use_repetition: bool = True, use_counts: bool = True,
) -> None:
    """Triton version of :func:`apply_penalties_ref`: one read and one write of ``x``, and only
    the table rows the batch uses (no gathered copies). The three settings share one stride."""
    require_triton()
    batch, vocab = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or counts.dtype != torch.int32 or seen.dtype != torch.bool:
        raise ValueError("x float32 with contiguous rows, counts int32, seen bool")
    if not (counts.is_contiguous() and seen.is_contiguous() and counts.shape[1] == vocab == seen.shape[1]):
        raise ValueError("counts and seen must be contiguous [rows, vocab]")
    stride = repetition.stride(0)
    if frequency.stride(0) != stride or presence.stride(0) != stride:
        raise ValueError("the settings must share one stride")
    if batch == 0 or not (use_repetition or use_counts):
        return
    block = 4096
    _penalties_kernel[(batch, cdiv(vocab, block))](
        x, x.stride(0), index.contiguous(), counts, seen.view(torch.uint8), vocab, repetition, frequency, presence,
        stride, USE_REP=use_repetition, USE_COUNTS=use_counts, BLOCK=block, num_warps=8,
    )


def apply_penalties(
    x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor,
    frequency: torch.Tensor, presence: torch.Tensor, use_repetition: bool = True, use_counts: bool = True,
) -> None:
    """Triton on CUDA tensors when Triton is installed, else :func:`apply_penalties_ref`."""
    if use_triton(x):
        apply_penalties_triton(x, index, counts, seen, repetition, frequency, presence, use_repetition, use_counts)
    else:
        apply_penalties_ref(x, index, counts, seen, repetition, frequency, presence, use_repetition, use_counts)
