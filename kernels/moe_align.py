"""The (token, expert) pairs of a routed step sorted by expert and padded per expert to the
grouped GEMM's row tile, on the device (no host reads: the step stays capturable in a CUDA graph).

Each expert's run starts on a tile boundary, so every row tile of the GEMMs belongs to one expert;
the buffers have their static upper bound (``pairs + min(experts, pairs) * (BLOCK_M - 1)`` rows)
and the tiles past the used ones hold -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import _INTERPRETED, HAS_TRITON, cdiv, next_pow2, require_triton, tl, triton


@dataclass(frozen=True)
class Alignment:
    """(token, expert) pairs sorted by expert and padded per expert to ``block_m`` rows."""

    #: ``[max_padded]`` int32: each row's pair index ``token * top_k + k``, ``num_pairs`` on padding.
    pairs: torch.Tensor
    #: ``[max_padded // block_m]`` int32: each row tile's expert (-1 past the used tiles).
    block_experts: torch.Tensor
    #: ``[1]`` int32: the rows in use (a multiple of ``block_m``); later tiles do nothing.
    num_padded: torch.Tensor
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows an alignment of ``num_pairs`` pairs can use: every expert that gets a pair
    (at most ``min(experts, pairs)``) pads its run by fewer than ``block_m`` rows."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the pairs of ``experts`` ``[T, top_k]`` by expert (a token's pairs in token order
    within each expert) and pad each expert's run to ``block_m`` rows, all on the device: no value
    is read on the host, so the step that calls it can be captured in a CUDA graph. On Triton's
    device: :func:`align_chunked` (the same layout in two launches where the torch ops take some
    thirty, a radix sort among them; on an H200, 128 experts: 13.5 us at 512 pairs where the
    torch ops take 77 us and the one-program kernel it replaces took 27 us; 93 against 126 us at
    32768 pairs)."""
    if (experts.is_cuda or _INTERPRETED) and HAS_TRITON and experts.numel() > 0:
        return align_chunked(experts, num_experts, block_m)
    return align_ref(experts, num_experts, block_m)


def align_ref(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """:func:`align` in torch ops (a dozen launches)."""
    flat = experts.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    dest = pad_start[sorted_experts] + torch.arange(num_pairs, device=device) - start[sorted_experts]
    pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, rows, block_m, device=device)
    block_experts = torch.searchsorted(pad_end, tile_starts, right=True)
    used = pad_end[-1:]
    block_experts = torch.where(tile_starts < used, block_experts, -1).to(torch.int32)
    return Alignment(pairs, block_experts, used.to(torch.int32), block_m)


#: Pairs a program of the chunked alignment takes (its one-hot tile: this many by the experts).
CHUNK_PAIRS = 128
#: Chunks' counts summed a step by each program of the chunked alignment's second launch.
CHUNK_ROWS = 64


@triton.jit
def _count_chunks_kernel(experts_ptr, counts_ptr, pairs_ptr, num_pairs, rows, rows_per_program,
                         E_BLOCK: tl.constexpr, CHUNK: tl.constexpr, R_BLOCK: tl.constexpr):
    # Program c: chunk c's count of each expert (a row of counts_ptr), and its share of the pair
    # rows set to the padding value (the second launch writes the real pairs over it).
    c = tl.program_id(0)
    e = tl.arange(0, E_BLOCK)
    p = c * CHUNK + tl.arange(0, CHUNK)
    flat = tl.load(experts_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    hot = (flat[:, None] == e[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * E_BLOCK + e, tl.sum(hot, axis=0))
    first = c * rows_per_program
    for r0 in range(first, first + rows_per_program, R_BLOCK):
        r = r0 + tl.arange(0, R_BLOCK)
        tl.store(pairs_ptr + r, tl.zeros((R_BLOCK,), dtype=tl.int32) + num_pairs,
                 mask=(r < rows) & (r < first + rows_per_program))


@triton.jit
def _place_chunks_kernel(experts_ptr, counts_ptr, pairs_ptr, block_experts_ptr, num_padded_ptr, num_pairs,
                         num_chunks, num_experts, rows, BM: tl.constexpr, E_BLOCK: tl.constexpr,
                         CHUNK: tl.constexpr, CHUNK_ROWS: tl.constexpr, TILES: tl.constexpr):
    # Program c: every expert's total and the pairs of the chunks before c (from the first
    # launch's counts), so each of chunk c's pairs gets its row: its expert's padded start, the
    # earlier chunks' pairs of that expert, then its rank within the chunk. Program 0 also writes
    # each row tile's expert and the rows in use.
    c = tl.program_id(0)
    e = tl.arange(0, E_BLOCK)
    ch = tl.arange(0, CHUNK_ROWS)
    total = tl.zeros((E_BLOCK,), dtype=tl.int32)
    before = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_ROWS):
        idx = c0 + ch
        counts = tl.load(counts_ptr + idx[:, None] * E_BLOCK + e[None, :], mask=(idx < num_chunks)[:, None], other=0)
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((idx < c)[:, None], counts, 0), axis=0)
    padded = (total + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    p = c * CHUNK + tl.arange(0, CHUNK)
    flat = tl.load(experts_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    hot = (flat[:, None] == e[None, :]).to(tl.int32)
    row = (pad_start + before)[None, :] + tl.cumsum(hot, axis=0) - 1
    tl.store(pairs_ptr + tl.sum(hot * row, axis=1), p, mask=p < num_pairs)
    if c == 0:
        used = tl.sum(padded, axis=0)
        t = tl.arange(0, TILES)
        for t0 in range(0, rows // BM, TILES):
            starts = (t0 + t) * BM
            owner = tl.sum(((pad_end[None, :] <= starts[:, None]) & (e[None, :] < num_experts)).to(tl.int32), axis=1)
            tl.store(block_experts_ptr + t0 + t, tl.where(starts < used, owner, -1), mask=starts < rows)
        tl.store(num_padded_ptr, used)


def align_chunked(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """:func:`align` in two launches of :data:`CHUNK_PAIRS` pairs a program (any number of pairs):
    each chunk's counts of each expert, then each chunk's pairs placed after the earlier chunks'."""
    require_triton()
    flat = experts.reshape(-1).contiguous()
    num_pairs = flat.numel()
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    device = flat.device
    pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        pairs.fill_(0)
        block_experts.fill_(-1)
        num_padded.fill_(0)
        return Alignment(pairs, block_experts, num_padded, block_m)
    e_block = next_pow2(max(num_experts, 16))
    num_chunks = cdiv(num_pairs, CHUNK_PAIRS)
    counts = torch.empty((num_chunks, e_block), dtype=torch.int32, device=device)
    _count_chunks_kernel[(num_chunks,)](flat, counts, pairs, num_pairs, rows, cdiv(rows, num_chunks), E_BLOCK=e_block,
                                        CHUNK=CHUNK_PAIRS, R_BLOCK=256, num_warps=8)
    _place_chunks_kernel[(num_chunks,)](flat, counts, pairs, block_experts, num_padded, num_pairs, num_chunks,
                                        num_experts, rows, BM=block_m, E_BLOCK=e_block, CHUNK=CHUNK_PAIRS,
                                        CHUNK_ROWS=CHUNK_ROWS, TILES=64, num_warps=8)
    return Alignment(pairs, block_experts, num_padded, block_m)
