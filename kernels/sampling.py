"""One token per row from its filtered distribution, without sorting the vocabulary.

Each row has a temperature, a top-k, a top-p, a min-p and a uniform ``u``. With
``e_i = exp(x_i / T - max)`` (the largest is 1), every cut is a threshold on ``e``:

- top-k keeps the tokens with ``e`` at least the k-th largest (ties at the cut are kept);
- top-p keeps the fewest largest tokens (of those top-k kept) whose mass reaches ``top_p`` of the
  kept total: ``e >= t`` for the largest ``t`` whose mass above it still reaches that share;
- min-p keeps ``e >= min_p`` (a share of the largest token's probability).

The token drawn is the first, in vocabulary order, whose cumulative kept mass exceeds ``u`` times
the kept total, so a row's token depends only on its own logits and ``u``.

A row without a cut (no top-k, top-p or min-p: temperature alone) needs no threshold, only the
draw, and that splits across programs as an argmax does: each slice of the row reports its
largest scaled logit and its mass below it, a second launch combines them, picks the slice where
the target falls and walks that slice alone. One program walking a whole 49k-token row four
times cost a batch-1 step of the default model 27 us; two short launches cost a few.

The reference finds the thresholds over one descending sort. The Triton kernel finds them by
bisecting the threshold's float bit pattern (positive floats order as their bits), one pass over
the row per probe, so a row costs a few dozen passes over data that stays in L2 instead of a sort
of the whole batch; both give the same token but where float sums in another order round across
a boundary.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, next_pow2, pdl_options, pdl_wait, require_triton, tl, triton, use_pdl, use_triton

#: Bit pattern of float32 1.0: the largest ``e`` (and threshold) there is.
_ONE_BITS = 0x3F800000
#: Probes of a bisection over [0, _ONE_BITS]: enough to pin one float32 exactly.
_PROBES = 31
#: Logits one program of an uncut row's first launch reads.
SLICE = 2048


def sample_filtered_ref(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Tokens ``[B]`` (int64) drawn from float32 logits ``x`` ``[B, V]``; per-row settings ``[B]``:
    ``temperature`` (> 0), ``top_k`` (int, >= vocab: no cut), ``top_p`` (1: no cut), ``min_p``
    (0: no cut), ``u`` in [0, 1). A row with no finite distribution (an infinite or NaN logit, or
    none above -inf) takes its most likely token, NaN read as -inf: never an id past the vocabulary."""
    kept = filtered_weights_ref(x, temperature, top_k, top_p, min_p)
    cdf = kept.cumsum(dim=-1)
    total = cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).squeeze(1)
    # u * total may round up to total: the last kept token holds that mass.
    vocab = x.shape[1]
    index = torch.arange(vocab, device=x.device).expand_as(kept)
    last = torch.where(kept > 0, index, -1).amax(dim=-1)
    drawn = torch.minimum(drawn, last)
    broken = ~torch.isfinite(total.squeeze(1)) | (total.squeeze(1) <= 0)
    return torch.where(broken, x.nan_to_num(nan=float("-inf")).argmax(dim=-1), drawn)


def filtered_weights_ref(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
) -> torch.Tensor:
    """``e`` of the tokens each row keeps, 0 elsewhere (the row's distribution, unnormalized)."""
    batch, vocab = x.shape
    scaled = x * (1.0 / temperature).unsqueeze(1)
    e = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    ordered = e.sort(dim=-1, descending=True).values
    k = top_k.clamp(1, vocab).unsqueeze(1)
    t_k = torch.where(top_k.unsqueeze(1) < vocab, ordered.gather(1, k - 1), torch.zeros_like(ordered[:, :1]))
    in_k = torch.where(ordered >= t_k, ordered, 0.0)
    mass = in_k.cumsum(dim=-1)
    target = top_p.unsqueeze(1) * mass[:, -1:]
    # The first position whose mass reaches the target: its e is the top-p threshold.
    n = torch.searchsorted(mass, target, right=False).clamp(max=vocab - 1)
    t_p = torch.where(top_p.unsqueeze(1) < 1.0, ordered.gather(1, n), torch.zeros_like(t_k))
    t = torch.maximum(torch.maximum(t_k, t_p), min_p.unsqueeze(1).to(e.dtype))
    return torch.where(e >= t, e, 0.0)


@triton.jit
def _row_e(e_row, start, offs, vocab):
    cols = start + offs
    valid = cols < vocab
    return tl.load(e_row + cols, mask=valid, other=0.0), cols, valid


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_uniform(row, u_ptr, k0_ptr, k1_ptr, pos_ptr, stride_key, HASH: tl.constexpr):
    """Row ``row``'s uniform: hashed from its stream keys (``HASH``; the uniform of
    pd_cluster.engine.random_stream.random_bits, in 32-bit lanes) or read from ``u_ptr``."""
    if HASH:
        k0 = tl.load(k0_ptr + row * stride_key).to(tl.uint32)
        k1 = tl.load(k1_ptr + row * stride_key).to(tl.uint32)
        position = tl.load(pos_ptr + row * stride_key).to(tl.uint32)
        bits = _fmix32(_fmix32(k0 ^ (position * 0x9E3779B1)) ^ k1)
        u = (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)
    else:
        u = tl.load(u_ptr + row)
    return u


@triton.jit
def _has_cut(row, vocab, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p, min_p_ptr, stride_min_p,
             USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr):
    """Whether row ``row`` keeps fewer than all its tokens: the filtered kernel's rows; the
    others go through the slices."""
    cut = tl.load(min_p_ptr + row * stride_min_p) > 0.0
    if USE_TOP_K:
        cut = cut | (tl.load(top_k_ptr + row * stride_top_k) < vocab)
    if USE_TOP_P:
        cut = cut | (tl.load(top_p_ptr + row * stride_top_p) < 1.0)
    return cut


@triton.jit
def _slice_mass_kernel(
    x_ptr, stride_x, vocab, temp_ptr, stride_temp, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p,
    min_p_ptr, stride_min_p, max_ptr, mass_ptr, arg_ptr, nans_ptr, num_slices,
    USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program: one slice of an uncut row. Its largest scaled logit (NaN read as -inf) and the
    # first index of it, its NaNs, and its mass below its largest: sum of exp(x / T - max).
    row = tl.program_id(0)
    part = tl.program_id(1)
    pdl_wait(USE_PDL)
    if not _has_cut(row, vocab, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p, min_p_ptr, stride_min_p,
                    USE_TOP_K, USE_TOP_P):
        cols = part * BLOCK + tl.arange(0, BLOCK)
        valid = cols < vocab
        inv_temperature = 1.0 / tl.load(temp_ptr + row * stride_temp)
        v = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=float("-inf")) * inv_temperature
        is_nan = v != v
        v = tl.where(is_nan, float("-inf"), v)
        best = tl.max(v, axis=0)
        where = tl.min(tl.where(valid & (v == best), cols, vocab), axis=0)
        # A slice of -inf only (or a +inf) weighs nothing or breaks the row: its shift is 0.
        shift = tl.where((best > float("-inf")) & (best < float("inf")), best, 0.0)
        mass = tl.sum(tl.where(valid, tl.exp(v - shift), 0.0), axis=0)
        at = row * num_slices + part
        tl.store(max_ptr + at, best)
        tl.store(mass_ptr + at, mass)
        tl.store(arg_ptr + at, where)
        tl.store(nans_ptr + at, tl.sum(is_nan.to(tl.int32), axis=0))


@triton.jit
def _slice_draw_kernel(
    x_ptr, stride_x, vocab, temp_ptr, stride_temp, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p,
    min_p_ptr, stride_min_p, max_ptr, mass_ptr, arg_ptr, nans_ptr, num_slices,
    u_ptr, k0_ptr, k1_ptr, pos_ptr, stride_key, out_ptr,
    USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, HASH: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program: one uncut row. The slices' masses rescaled to the row's largest logit, the first
    # slice whose cumulative mass exceeds u times the total, then that slice's first token whose
    # cumulative mass exceeds what is left of the target (its last token with mass if rounding
    # leaves the target at its end).
    row = tl.program_id(0)
    pdl_wait(USE_PDL)
    if not _has_cut(row, vocab, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p, min_p_ptr, stride_min_p,
                    USE_TOP_K, USE_TOP_P):
        p = tl.arange(0, BLOCK_P)
        ok = p < num_slices
        at = row * num_slices + p
        best = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
        mass = tl.load(mass_ptr + at, mask=ok, other=0.0)
        nans = tl.sum(tl.load(nans_ptr + at, mask=ok, other=0), axis=0)
        row_max = tl.max(best, axis=0)
        row_arg = tl.min(tl.where(ok & (best == row_max), tl.load(arg_ptr + at, mask=ok, other=vocab), vocab), axis=0)
        finite = (row_max > float("-inf")) & (row_max < float("inf"))
        shift = tl.where(finite, row_max, 0.0)
        weight = tl.where(ok & (best > float("-inf")), mass * tl.exp(tl.where(best > float("-inf"), best, 0.0) - shift),
                          0.0)
        total = tl.sum(weight, axis=0)
        target = _row_uniform(row, u_ptr, k0_ptr, k1_ptr, pos_ptr, stride_key, HASH) * total
        cumulative = tl.cumsum(weight, axis=0)
        crossing = (cumulative > target) & (weight > 0)
        chosen = tl.min(tl.where(crossing, p, num_slices), axis=0)
        last_slice = tl.max(tl.where(weight > 0, p, -1), axis=0)
        chosen = tl.where(chosen < num_slices, chosen, last_slice)
        before = tl.sum(tl.where(p < chosen, weight, 0.0), axis=0)
        left = target - before
        # The chosen slice, token by token.
        cols = tl.maximum(chosen, 0) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < vocab
        inv_temperature = 1.0 / tl.load(temp_ptr + row * stride_temp)
        v = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=float("-inf")) * inv_temperature
        e = tl.where(valid, tl.exp(v - shift), 0.0)
        running = tl.cumsum(e, axis=0)
        found = tl.min(tl.where((running > left) & (e > 0), cols, vocab), axis=0)
        last = tl.max(tl.where(e > 0, cols, -1), axis=0)
        token = tl.where(found < vocab, found, last)
        good = (nans == 0) & finite & (total > 0) & (last >= 0)
        tl.store(out_ptr + row, tl.where(good, token, row_arg).to(tl.int64))


@triton.jit
def _sample_kernel(
    x_ptr, stride_x, e_ptr, vocab, temp_ptr, stride_temp, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p,
    min_p_ptr, stride_min_p, u_ptr, k0_ptr, k1_ptr, pos_ptr, stride_key, out_ptr,
    USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, HASH: tl.constexpr, PROBES: tl.constexpr,
    ONE_BITS: tl.constexpr, BLOCK: tl.constexpr, DRAW_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    # Rows with a cut only: the others are drawn through the slices.
    if _has_cut(row, vocab, top_k_ptr, stride_top_k, top_p_ptr, stride_top_p, min_p_ptr, stride_min_p,
                USE_TOP_K, USE_TOP_P):
        x_row = x_ptr + row.to(tl.int64) * stride_x
        e_row = e_ptr + row.to(tl.int64) * vocab
        inv_temperature = 1.0 / tl.load(temp_ptr + row * stride_temp)
        offs = tl.arange(0, BLOCK)

        # Passes accumulate per lane and reduce once at the end: a reduction per block would cost
        # the whole block a barrier each time.
        # The largest logit and its first index (NaN read as -inf): the token of a broken row.
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_arg = offs
        lane_nans = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            v = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")) * inv_temperature
            is_nan = v != v
            v = tl.where(is_nan, float("-inf"), v)
            better = v > lane_max
            lane_arg = tl.where(better, cols, lane_arg)
            lane_max = tl.where(better, v, lane_max)
            lane_nans += is_nan.to(tl.int32)
        row_max = tl.max(lane_max, axis=0)
        row_arg = tl.min(tl.where(lane_max == row_max, lane_arg, vocab), axis=0)
        nans = tl.sum(lane_nans, axis=0)

        # e = exp(x / T - max) once, into this row's scratch: every later pass only loads and compares.
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            valid = cols < vocab
            v = tl.load(x_row + cols, mask=valid, other=float("-inf")) * inv_temperature
            tl.store(e_row + cols, tl.exp(v - row_max), mask=valid)

        # top-k: the largest t with at least k tokens at or above it.
        t_k = 0.0
        if USE_TOP_K:
            k = tl.load(top_k_ptr + row * stride_top_k)
            if k < vocab:
                lo = 0
                hi = ONE_BITS
                for _ in range(PROBES):
                    mid = (lo + hi + 1) // 2
                    t = mid.to(tl.float32, bitcast=True)
                    count = tl.zeros([BLOCK], tl.int32)
                    for start in range(0, vocab, BLOCK):
                        e, cols, valid = _row_e(e_row, start, offs, vocab)
                        count += (valid & (e >= t)).to(tl.int32)
                    ok = tl.sum(count, axis=0) >= k
                    lo = tl.where(ok, mid, lo)
                    hi = tl.where(ok, hi, mid - 1)
                t_k = lo.to(tl.float32, bitcast=True)

        # top-p: the largest t whose kept mass at or above it reaches top_p of the top-k mass.
        t_p = 0.0
        if USE_TOP_P:
            top_p = tl.load(top_p_ptr + row * stride_top_p)
            if top_p < 1.0:
                lane_total = tl.zeros([BLOCK], tl.float32)
                for start in range(0, vocab, BLOCK):
                    e, cols, valid = _row_e(e_row, start, offs, vocab)
                    lane_total += tl.where(e >= t_k, e, 0.0)
                target = top_p * tl.sum(lane_total, axis=0)
                lo = 0
                hi = ONE_BITS
                for _ in range(PROBES):
                    mid = (lo + hi + 1) // 2
                    t = tl.maximum(mid.to(tl.float32, bitcast=True), t_k)
                    mass = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, vocab, BLOCK):
                        e, cols, valid = _row_e(e_row, start, offs, vocab)
                        mass += tl.where(e >= t, e, 0.0)
                    ok = tl.sum(mass, axis=0) >= target
                    lo = tl.where(ok, mid, lo)
                    hi = tl.where(ok, hi, mid - 1)
                t_p = lo.to(tl.float32, bitcast=True)

        cut = tl.maximum(tl.maximum(t_k, t_p), tl.load(min_p_ptr + row * stride_min_p))
        lane_total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            e, cols, valid = _row_e(e_row, start, offs, vocab)
            lane_total += tl.where(e >= cut, e, 0.0)
        total = tl.sum(lane_total, axis=0)
        target = _row_uniform(row, u_ptr, k0_ptr, k1_ptr, pos_ptr, stride_key, HASH) * total

        # The first token whose cumulative kept mass exceeds the target; the last kept one if rounding
        # puts the target at the total.
        carry = 0.0
        found = vocab
        last = -1
        draw_offs = tl.arange(0, DRAW_BLOCK)
        for start in range(0, vocab, DRAW_BLOCK):
            e, cols, valid = _row_e(e_row, start, draw_offs, vocab)
            kept = tl.where(valid & (e >= cut), e, 0.0)
            cumulative = tl.cumsum(kept, axis=0) + carry
            found = tl.minimum(found, tl.min(tl.where((cumulative > target) & (kept > 0), cols, vocab), axis=0))
            last = tl.maximum(last, tl.max(tl.where(kept > 0, cols, -1), axis=0))
            carry += tl.sum(kept, axis=0)
        token = tl.where(found < vocab, found, last)
        ok = (nans == 0) & (row_max < float("inf")) & (row_max > float("-inf")) & (total > 0)
        tl.store(out_ptr + row, tl.where(ok, token, row_arg).to(tl.int64))


def sample_filtered_triton(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    u: torch.Tensor | None = None, use_top_k: bool = True, use_top_p: bool = True,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, block: int = 16384, num_warps: int = 16,
    slice_size: int = SLICE,
) -> torch.Tensor:
    """Triton version of :func:`sample_filtered_ref`. The settings may be strided columns
    (temperature, top_p, min_p float32; top_k int64). Instead of ``u``, ``keys`` (k0, k1,
    position: int64 columns of one stride) have the kernel hash each row's uniform itself, as
    :func:`pd_cluster.engine.random_stream.random_bits` does. ``use_top_k`` / ``use_top_p`` False skip
    the cut's code for the whole batch (no row has it).

    Rows with a cut: one program walks a whole row per pass. The first two passes find the row's
    largest logit and write ``e`` to a scratch row; the threshold probes then only load and
    compare (the scratch of a batch stays in L2), with wide blocks so a 128k vocabulary takes few
    of them. Rows without one: ``slice_size`` logits a program, then a program a row (see the
    module's docstring). All three launches run for every batch, each skipping the others' rows:
    which way a row goes depends on its own settings alone, so a request draws the same tokens in
    any batch (and in a captured draw, whose rows' settings change from replay to replay)."""
    require_triton()
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError("x must be float32 with contiguous rows")
    batch, vocab = x.shape
    out = torch.empty(batch, dtype=torch.int64, device=x.device)
    if batch == 0:
        return out
    if (u is None) == (keys is None):
        raise ValueError("give either u or keys")
    if keys is None:
        assert u is not None
        u = u.to(torch.float32).contiguous()
        k0 = k1 = pos = out  # unused
        key_stride = 0
    else:
        k0, k1, pos = keys
        key_stride = k0.stride(0)
        if k1.stride(0) != key_stride or pos.stride(0) != key_stride:
            raise ValueError("keys must share one stride")
        u = out  # unused
    columns = [t if t.dtype == dtype else t.to(dtype) for t, dtype in
               ((temperature, torch.float32), (top_k, torch.int64), (top_p, torch.float32), (min_p, torch.float32))]
    settings = (columns[0], columns[0].stride(0), columns[1], columns[1].stride(0), columns[2], columns[2].stride(0),
                columns[3], columns[3].stride(0))
    pdl = use_pdl(x)
    slices = cdiv(vocab, slice_size)
    slice_max = torch.empty((batch, slices), dtype=torch.float32, device=x.device)
    slice_mass = torch.empty_like(slice_max)
    slice_arg = torch.empty((batch, slices), dtype=torch.int32, device=x.device)
    slice_nans = torch.empty_like(slice_arg)
    _slice_mass_kernel[(batch, slices)](
        x, x.stride(0), vocab, *settings, slice_max, slice_mass, slice_arg, slice_nans, slices,
        USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, BLOCK=slice_size, USE_PDL=pdl, num_warps=4, **pdl_options(pdl),
    )
    _slice_draw_kernel[(batch,)](
        x, x.stride(0), vocab, *settings, slice_max, slice_mass, slice_arg, slice_nans, slices, u, k0, k1, pos,
        key_stride, out, USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, HASH=keys is not None, BLOCK=slice_size,
        BLOCK_P=max(16, next_pow2(slices)), USE_PDL=pdl, num_warps=4, **pdl_options(pdl),
    )
    scratch = torch.empty((batch, vocab), dtype=torch.float32, device=x.device)
    _sample_kernel[(batch,)](
        x, x.stride(0), scratch, vocab, *settings, u, k0, k1, pos, key_stride, out,
        USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, HASH=keys is not None, PROBES=_PROBES, ONE_BITS=_ONE_BITS,
        BLOCK=block, DRAW_BLOCK=block, USE_PDL=pdl, num_warps=num_warps, **pdl_options(pdl),
    )
    return out


def sample_filtered(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    u: torch.Tensor, use_top_k: bool = True, use_top_p: bool = True,
) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`sample_filtered_ref`."""
    if use_triton(x):
        return sample_filtered_triton(x, temperature, top_k, top_p, min_p, u, use_top_k, use_top_p)
    return sample_filtered_ref(x, temperature, top_k, top_p, min_p, u)
