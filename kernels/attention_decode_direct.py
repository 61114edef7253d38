"""Decode attention over an fp8 e4m3 KV cache with each tile's codes loaded straight into the
registers the tensor cores read (Gluon: explicit layouts), no shared memory between the load and
the product.

Why: a quantized tile written by :mod:`kernels.attention_decode`'s Triton kernel must become the
products' dtype before the tensor cores meet it, and Triton takes it there through shared memory
(loaded, converted, stored, read back by matrix loads): on an H200 that kernel issued about 39
instructions a key and a warp, and read fp8 KV no faster than bfloat16 KV, half the bytes.

How: a dot product does not depend on the order of ``head_dim`` as long as both sides take the
same order. Each thread loads 32 contiguous bytes of a key (two 16-byte loads), and the kernel
*names* those bytes the elements the tensor-core fragment wants of that thread (a relabelling of
``head_dim``, :func:`_key_order`); q is loaded once and permuted the same way. The values meet
the product ``out^T = v^T p^T`` as its first operand, 16 contiguous bytes of a key a thread, their
``head_dim`` relabelled likewise (:func:`_value_order`) and undone on the output. The products run
in float16 (e4m3 codes convert to it in one instruction a pair, q scaled into it a power of two a
row), the key scales multiply the scores, the value scales enter them as logs (the weights the
product takes are the scaled ones, each at most 1: no float16 underflow); one warp a program, a
split of one sequence's keys for all q heads of one kv head, merged by
:mod:`kernels.attention_decode`'s merge kernels.

Needs Gluon (Triton's explicit-layout language, Triton 3.6+), compute capability 8.9 or 9.x (fp8
conversions; later GPUs keep the Triton kernel until this one is measured there), ``head_dim``
128, up to 8 q heads a kv head, both caches of the same strides; elsewhere the Triton kernel runs
(:func:`direct_decode_fits`). Gluon is not interpreted: a CPU test compiles this kernel for sm_90
and reads its machine code, the GPU tests check its output against the reference.
"""

from __future__ import annotations

import logging

import torch

from kernels._triton import _INTERPRETED, HAS_TRITON, _capability, device_index, use_pdl

log = logging.getLogger(__name__)

#: ``head_dim`` the layouts are written for.
HEAD_DIM = 128
#: Most q heads a kv head (the score tile's rows that reach the value product).
MAX_GROUP = 8
#: Keys a tile (16, 32 or 64: a multiple of the value product's k step of 16). Measured on an
#: H200 in the engine's decode step (8B shape, batch 64 x 4k context, CUDA graphs, fp8 KV over
#: bf16, two interleaved repeats): 64 keys 0.83 of bf16's step at 4 splits, 32 keys 1.10 (at 5
#: and 16 splits), 16 keys 0.94 (8 or 16 splits) and 1.05 (4). A 64-key tile keeps 16 KB of a
#: program's reads in flight at once (220 registers a thread, 9 programs an SM).
BLOCK_N = 64
#: One-warp programs per multiprocessor the split count aims at: 15 gives 4 splits at 64
#: sequences x 8 kv heads on 132 multiprocessors (the step above: 3 splits 0.88, 4 0.83, 8 0.86).
PROGRAMS_PER_SM = 15
#: Whether a program lets the next kernel (the merge) launch as it starts rather than as it ends:
#: the merge's waiting programs would hold multiprocessor slots the splits need (the step above
#: at 4 splits of 16 keys: 1.05 either way; the microbenchmark of ``kv_attn_sweep`` 0.63 early
#: and 0.61 late, one run each), so as it ends.
DEPENDENTS_EARLY = False

#: Oldest Triton whose Gluon compiles this kernel as measured (3.6 on the GPU machines; 3.9 compiles
#: it the same for the CPU test); Gluon is experimental and its API moves between releases.
MIN_TRITON = (3, 6)

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAS_GLUON = HAS_TRITON and tuple(int(p) for p in triton.__version__.split(".")[:2]) >= MIN_TRITON
except (ImportError, ValueError):  # no Triton, one without Gluon or of an unknown version: the Triton kernel runs
    HAS_GLUON = False


def direct_decode_fits(quant: str | None, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_split_direct` takes this launch: fp8 e4m3 rows, q in a 16-bit
    dtype, ``head_dim`` :data:`HEAD_DIM`, at most :data:`MAX_GROUP` q heads a kv head, K and V
    caches of the same strides, a GPU of compute capability 8.9 or 9.x, compiled (not interpreted)."""
    if not HAS_GLUON or _INTERPRETED or quant != "fp8_e4m3" or not q.is_cuda:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] != HEAD_DIM:
        return False
    num_kv_heads = k_cache.shape[1]
    if q.shape[1] % num_kv_heads or q.shape[1] // num_kv_heads > MAX_GROUP:
        return False
    if k_cache.stride()[:2] != v_cache.stride()[:2]:
        return False
    # Measured on Hopper; Ada has the same warp-level products and fp8 conversions. Later GPUs keep
    # the Triton kernel until the direct one is measured there.
    return (8, 9) <= _capability(device_index(q.device)) < (10, 0)


if HAS_GLUON:

    #: :data:`HEAD_DIM` as the jitted functions read it.
    _HEAD_DIM = gl.constexpr(HEAD_DIM)

    @gluon.constexpr_function
    def _mma_layout():
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def _tile_layout(block_n, reg_bases, lane_bases):
        """A tile ``[block_n, 128]`` as stored: ``reg_bases`` and ``lane_bases`` for its first 8
        keys, later keys in registers."""
        key_regs = [[1 << b, 0] for b in range(3, block_n.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=reg_bases + key_regs, lane_bases=lane_bases, warp_bases=[],
                                          block_bases=[], shape=[block_n, HEAD_DIM])

    @gluon.constexpr_function
    def _key_load_layout(block_n):
        """A key tile: 32 contiguous bytes of a key a thread, the key in the lane's group of four
        (``lane // 4``)."""
        return _tile_layout(block_n, [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]],
                            [[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]])

    @gluon.constexpr_function
    def _value_load_layout(block_n):
        """A value tile: 16 contiguous bytes of a key a thread, keys ``2t, 2t + 1`` (``t = lane % 4``)."""
        return _tile_layout(block_n, [[0, 1], [0, 2], [0, 4], [0, 8], [1, 0]],
                            [[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]])

    @gluon.jit
    def _key_order(x, ROWS: gl.constexpr):
        """``x`` ``[ROWS, 128]`` with ``head_dim`` renamed: stored byte ``m`` (bits m0..m6) becomes
        element ``k`` with k0 = m0, k1 = m5, k2 = m6, k3..k6 = m1..m4, so the 32 bytes a thread
        loads are its fragment of the score product (bits k0, k3..k6 in registers, k1, k2 in the
        lane). No data moves: the names change."""
        x = gl.reshape(x, [ROWS, 2, 2, 2, 2, 2, 2, 2])  # m6 m5 m4 m3 m2 m1 m0
        x = gl.permute(x, [0, 3, 4, 5, 6, 1, 2, 7])  # k6..k0 = m4 m3 m2 m1 m6 m5 m0
        return gl.reshape(x, [ROWS, _HEAD_DIM])

    @gluon.jit
    def _value_order(x, ROWS: gl.constexpr):
        """``x`` ``[ROWS, 128]`` with stored byte ``m`` named ``8 * (m % 16) + m // 16``: the 16
        bytes a thread loads are the output columns of its fragment of the value product."""
        return gl.reshape(gl.permute(gl.reshape(x, [ROWS, 8, 16]), [0, 2, 1]), [ROWS, _HEAD_DIM])

    @gluon.jit
    def _value_unorder(x, ROWS: gl.constexpr):
        """The inverse of :func:`_value_order`: output columns back to ``head_dim``'s order."""
        return gl.reshape(gl.permute(gl.reshape(x, [ROWS, 16, 8]), [0, 2, 1]), [ROWS, _HEAD_DIM])

    @gluon.jit
    def _first_rows(s, N: gl.constexpr):
        """Rows 0..7 of a score tile ``[16, N]``: the registers of rows 8..15 dropped, the rest the
        second operand of the value product as they lie."""
        lo, hi = gl.split(gl.permute(gl.reshape(s, [2, 8, N]), [1, 2, 0]))
        return lo

    @gluon.jit
    def _first_half(x):
        lo, hi = gl.split(gl.permute(gl.reshape(x, [2, 8]), [1, 0]))
        return lo

    @gluon.jit
    def _log2_approx(x):
        return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _reciprocal_approx(x):
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _pdl_wait(USE_PDL: gl.constexpr):
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)

    @gluon.jit
    def _pdl_launch_dependents(USE_PDL: gl.constexpr):
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _attend_tile(q_op, acc, m_i, l_i, row_factor, k_ptr, v_ptr, table_row, head_off, stride_s, first, hi,
                     s_zero, S8: gl.constexpr, BLOCK: gl.constexpr, MASKED: gl.constexpr):
        """One tile of ``BLOCK`` keys from ``first`` (``MASKED``: those before ``hi``)."""
        MMA: gl.constexpr = _mma_layout()
        K_LOAD: gl.constexpr = _key_load_layout(BLOCK)
        V_LOAD: gl.constexpr = _value_load_layout(BLOCK)
        kn = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, K_LOAD))
        kd = gl.arange(0, _HEAD_DIM, layout=gl.SliceLayout(0, K_LOAD))
        vn = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, V_LOAD))
        vd = gl.arange(0, _HEAD_DIM, layout=gl.SliceLayout(0, V_LOAD))
        if MASKED:
            k_slots = gl.load(table_row + first + kn, mask=first + kn < hi, other=0)
            v_slots = gl.load(table_row + first + vn, mask=first + vn < hi, other=0)
        else:
            k_slots = gl.load(table_row + first + kn)
            v_slots = gl.load(table_row + first + vn)
        # Slots are never negative: unsigned, one wide multiply-add an address.
        k_rows = k_slots.to(gl.uint32).to(gl.int64) * stride_s + head_off
        v_rows = v_slots.to(gl.uint32).to(gl.int64) * stride_s + head_off
        k = gl.load(k_ptr + k_rows[:, None] + kd[None, :])
        v = gl.load(v_ptr + v_rows[:, None] + vd[None, :])
        # The scores' columns lie in the threads that hold the values' keys: the same rows.
        s_rows = gl.convert_layout(v_rows, gl.SliceLayout(0, S8), assert_trivial=True)
        k_scale = gl.load((k_ptr + s_rows + _HEAD_DIM).to(gl.pointer_type(gl.float32)))
        v_scale = gl.load((v_ptr + s_rows + _HEAD_DIM).to(gl.pointer_type(gl.float32)))

        k16 = k.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        k_op = gl.convert_layout(gl.permute(_key_order(k16, BLOCK), [1, 0]), gl.DotOperandLayout(1, MMA, 2),
                                 assert_trivial=True)
        s = _first_rows(mma_v2(q_op, k_op, s_zero), BLOCK)
        s = s * row_factor[:, None] * k_scale[None, :] + _log2_approx(v_scale)[None, :]
        if MASKED:
            sn = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, S8))
            s = gl.where((first + sn < hi)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p * _reciprocal_approx(v_scale)[None, :], axis=1)
        p_op = gl.convert_layout(gl.permute(p.to(gl.float16), [1, 0]), gl.DotOperandLayout(1, MMA, 2),
                                 assert_trivial=True)
        v16 = v.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        v_op = gl.convert_layout(gl.permute(_value_order(v16, BLOCK), [1, 0]), gl.DotOperandLayout(0, MMA, 2))
        alpha_c = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
        acc = mma_v2(v_op, p_op, acc * alpha_c[None, :])
        return acc, m_new, l_i

    @gluon.jit
    def _decode_split_direct_kernel(q_ptr, k_ptr, v_ptr, table_ptr, ctx_lens_ptr, rows_ptr, part_out_ptr,
                                    part_lse_ptr, scale_log2, stride_qb, stride_qh, stride_s, stride_h,
                                    stride_table, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                                    GROUP: gl.constexpr, NUM_SPLITS: gl.constexpr, BLOCK: gl.constexpr,
                                    HAS_ROWS: gl.constexpr, USE_PDL: gl.constexpr, DEPENDENTS_EARLY: gl.constexpr):
        MMA: gl.constexpr = _mma_layout()
        Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
        kv_head = gl.program_id(0)
        seq = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        if DEPENDENTS_EARLY:
            _pdl_launch_dependents(USE_PDL)
        _pdl_wait(USE_PDL)
        ctx_len = gl.load(ctx_lens_ptr + seq).to(gl.int32)
        split_len = gl.cdiv(gl.cdiv(ctx_len, NUM_SPLITS), BLOCK) * BLOCK
        lo = split * split_len
        hi = gl.minimum(lo + split_len, ctx_len)
        if HAS_ROWS:
            row = gl.load(rows_ptr + seq).to(gl.int64)
        else:
            row = seq
        table_row = table_ptr + row * stride_table
        head_off = kv_head.to(gl.int64) * stride_h

        # q: 16 rows (the product's least), GROUP of them real, as float16 in a power of two a row.
        qr = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_LOAD))
        qd = gl.arange(0, _HEAD_DIM, layout=gl.SliceLayout(0, Q_LOAD))
        q = gl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + qr)[:, None] * stride_qh + qd[None, :],
                    mask=(qr < GROUP)[:, None], other=0.0).to(gl.float32)
        amax_exp = (gl.max(gl.abs(q), axis=1).to(gl.int32, bitcast=True) >> 23) & 0xFF
        amax_exp = gl.minimum(gl.maximum(amax_exp, 1), 253)
        unit = (amax_exp << 23).to(gl.float32, bitcast=True)
        inv_unit = ((254 - amax_exp) << 23).to(gl.float32, bitcast=True)
        q16 = (q * inv_unit[:, None]).to(gl.float16)
        q_op = gl.convert_layout(_key_order(q16, 16), gl.DotOperandLayout(0, MMA, 2))

        s_zero = gl.zeros([16, BLOCK], gl.float32, MMA)
        S8: gl.constexpr = _first_rows(s_zero, BLOCK).type.layout
        row_factor = gl.convert_layout(_first_half(unit * scale_log2), gl.SliceLayout(1, S8))
        m_i = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(1, S8))
        l_i = gl.zeros([8], gl.float32, gl.SliceLayout(1, S8))
        acc = gl.zeros([_HEAD_DIM, 8], gl.float32, MMA)

        full_end = lo + gl.maximum(hi - lo, 0) // BLOCK * BLOCK
        for first in range(lo, full_end, BLOCK):
            acc, m_i, l_i = _attend_tile(q_op, acc, m_i, l_i, row_factor, k_ptr, v_ptr, table_row, head_off,
                                         stride_s, first, hi, s_zero, S8, BLOCK, False)
        if full_end < hi:
            acc, m_i, l_i = _attend_tile(q_op, acc, m_i, l_i, row_factor, k_ptr, v_ptr, table_row, head_off,
                                         stride_s, full_end, hi, s_zero, S8, BLOCK, True)

        # An empty split reports lse = -inf and weighs nothing in the merge.
        has_keys = l_i > 0.0
        lse = gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, 1.0)), float("-inf"))
        l_cols = gl.convert_layout(gl.where(has_keys, l_i, 1.0), gl.SliceLayout(0, MMA))
        out = _value_unorder(gl.permute(acc / l_cols[None, :], [1, 0]), 8)
        OUT: gl.constexpr = out.type.layout
        o_row = gl.arange(0, 8, layout=gl.SliceLayout(1, OUT))
        o_d = gl.arange(0, _HEAD_DIM, layout=gl.SliceLayout(0, OUT))
        gl.store(part_out_ptr + seq * stride_pb + (kv_head * GROUP + o_row)[:, None] * stride_ph + split * stride_ps
                 + o_d[None, :], out.to(part_out_ptr.dtype.element_ty), mask=(o_row < GROUP)[:, None])
        l_row = gl.arange(0, 8, layout=gl.SliceLayout(1, S8))
        gl.store(part_lse_ptr + seq * stride_lb + (kv_head * GROUP + l_row) * stride_lh + split, lse,
                 mask=l_row < GROUP)
        if not DEPENDENTS_EARLY:
            _pdl_launch_dependents(USE_PDL)


def direct_num_splits(batch: int, num_kv_heads: int, max_ctx: int, device: torch.device, max_splits: int) -> int:
    """Enough one-warp programs for :data:`PROGRAMS_PER_SM` a multiprocessor, never a split
    shorter than a tile, at most ``max_splits``; fixed by shapes (the same launch every step)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-PROGRAMS_PER_SM * sms // max(1, batch * num_kv_heads))
    return max(1, min(wanted, -(-max_ctx // BLOCK_N), max_splits))


def decode_split_direct(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                        ctx_lens: torch.Tensor, scale_log2: float, part_out: torch.Tensor, part_lse: torch.Tensor,
                        table_rows: torch.Tensor | None, num_splits: int) -> None:
    """The split stage of :func:`kernels.attention_decode.decode_attention_triton` by the direct
    kernel (where :func:`direct_decode_fits`): each split's normalised output into ``part_out``
    ``[B, Hq, S, D]`` and its log-sum-exp (base 2) into ``part_lse`` ``[B, Hq, S]``."""
    batch, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    pdl = use_pdl(q)
    _decode_split_direct_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, slot_table, ctx_lens, table_rows if table_rows is not None else ctx_lens, part_out,
        part_lse, scale_log2, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), slot_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=num_q_heads // num_kv_heads, NUM_SPLITS=num_splits, BLOCK=BLOCK_N, HAS_ROWS=table_rows is not None,
        USE_PDL=pdl, DEPENDENTS_EARLY=DEPENDENTS_EARLY, num_warps=1, **({"launch_pdl": True} if pdl else {}),
    )
