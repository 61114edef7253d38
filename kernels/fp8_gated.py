"""The gate/up product of an FP8 decode batch with the SiLU gate in its epilogue.

Unfused, a decode step's MLP ran the gate/up GEMM (its ``[rows, 2 * I]`` output written in the
model's dtype), then a kernel reading that output back to gate it (``silu(gate) * up``) and a
kernel quantizing the gated rows for the down projection. Here each program multiplies the
activations by the weight rows of ``BN`` gate channels and of the same ``BN`` up channels (two
products a block, the fused weight as it is stored: gate rows, then up rows), gates them itself and
writes the gated values and each row's amax over its columns; one launch of
:func:`kernels.fp8_act.quantize_parts` turns them into the down projection's codes. A launch and a
write and read of the gate/up output fewer.

Every rounding of the unfused path is repeated (the products rounded to the model's dtype as the
GEMM stores them, the activation and the gated value as the SiLU kernel stores them), so the codes
are the unfused ones wherever the products are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import cdiv, last_dim_contiguous, pdl_options, pdl_wait, require_triton, tl, triton, use_pdl
from kernels.fp8_act import FP8, quantize_parts
from kernels.fp8_gemm import TensorDescriptor, describable, sm90


@dataclass(frozen=True)
class GatedConfig:
    """Tiles of :func:`fp8_gate_up_silu_triton`: ``block_n`` gated outputs a program (its gate and
    up channels both), ``block_k`` inputs a stage."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = True


#: One H200, the 8B shape at 64 rows: the gate/up GEMM's own tiles (64 x 128 x 128, four stages,
#: by descriptor), each program's 128 weight rows now half gate and half up.
GATED_CONFIG = GatedConfig()
#: Rows the gated GEMM serves: 33 to 64. One H200, 8B shape, the decode step against the SiLU
#: kernels after the plain GEMM: 64 rows 0.98x (5.32 against 5.42 ms, graphs replayed), 32 rows
#: 1.02x and 16 rows 1.08x with these tiles (the plain GEMM's own there are narrower).
GATED_MIN_ROWS = 33


@triton.jit
def _fp8_gate_up_silu_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, y_ptr, amax_ptr, M, I, K, stride_x, stride_w,
                             stride_y, stride_amax, TMA: tl.constexpr, IMPRECISE: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr):
    # Program: BM rows x BN gated outputs, from the gate's channels [n0, n0 + BN) and the up's
    # [I + n0, I + n0 + BN). TMA: x_ptr and w_ptr are tensor descriptors ([M, K] by [BM, BK];
    # [2I, K] by [BN, BK]).
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < I
    if not TMA:
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
        g_rows = w_ptr + rn[None, :].to(tl.int64) * stride_w
        u_rows = w_ptr + (rn[None, :] + I).to(tl.int64) * stride_w
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if TMA:
            a = x_ptr.load([pid_m * BM, k0])
            wg = w_ptr.load([pid_n * BN, k0]).T
            wu = w_ptr.load([I + pid_n * BN, k0]).T
        else:
            k_mask = (k0 + rk) < K
            a = tl.load(x_rows + k0 + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(g_rows + k0 + rk[:, None], mask=w_mask, other=0.0, eviction_policy="evict_first")
            wu = tl.load(u_rows + k0 + rk[:, None], mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc_g = tl.dot(a, wg, acc_g, max_num_imprecise_acc=IMPRECISE)
        acc_u = tl.dot(a, wu, acc_u, max_num_imprecise_acc=IMPRECISE)
    dtype = y_ptr.dtype.element_ty
    x_scale = tl.load(x_scale_ptr + rm, mask=m_mask, other=0.0)[:, None]
    # As the GEMM scales and stores each product, then as the SiLU kernel gates what it reads.
    gate = (acc_g * x_scale * tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)[None, :]).to(dtype).to(tl.float32)
    up = (acc_u * x_scale * tl.load(w_scale_ptr + I + rn, mask=n_mask, other=0.0)[None, :]).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    ok = m_mask[:, None] & n_mask[None, :]
    y = tl.where(ok, (act * up).to(dtype).to(tl.float32), 0.0)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], y.to(dtype), mask=ok)
    tl.store(amax_ptr + rm.to(tl.int64) * stride_amax + pid_n, tl.max(tl.abs(y), axis=1), mask=m_mask)


def fp8_gate_up_silu_triton(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, config: GatedConfig | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The down projection's input codes of ``silu(gate) * up``, where ``[gate, up] = (xq * x_scale)
    @ (weight * w_scale[:, None]).T`` in ``out_dtype``: ``xq`` ``[M, K]`` e4m3 codes with a float32
    scale a row, ``weight`` ``[2I, K]`` e4m3 (gate rows, then up rows) with a float32 scale a
    channel. Returns ``(codes [M, I], scales [M, 1])``, those of
    ``silu_mul_quant_fp8_triton(fp8_gemm_triton(...))``."""
    require_triton()
    cfg = config or GATED_CONFIG
    xq = last_dim_contiguous(xq)
    weight = last_dim_contiguous(weight)
    m, k = xq.shape
    two_i = weight.shape[0]
    inter = two_i // 2
    if weight.shape[1] != k or two_i != 2 * inter:
        raise ValueError(f"weight {tuple(weight.shape)} is no fused gate/up over {k} inputs")
    if xq.dtype != FP8 or weight.dtype != FP8:
        raise ValueError(f"float8 e4m3 operands, not {xq.dtype} and {weight.dtype}")
    x_scale = x_scale.reshape(-1).contiguous()
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (two_i,) or x_scale.dtype != torch.float32 \
            or x_scale.numel() != m:
        raise ValueError("float32 scales, one a row and one an output channel")
    gated = torch.empty((m, inter), dtype=out_dtype, device=xq.device)
    tiles = cdiv(inter, cfg.block_n)
    amax = torch.empty((m, tiles), dtype=torch.float32, device=xq.device)
    if m == 0 or inter == 0:
        return quantize_parts(gated, amax)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    tma = cfg.tma and sm90(xq) and TensorDescriptor is not None and describable(xq) and describable(weight)
    x_arg = TensorDescriptor.from_tensor(xq, [block_m, cfg.block_k]) if tma else xq
    w_arg = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]) if tma else weight
    pdl = use_pdl(xq)
    _fp8_gate_up_silu_kernel[(tiles, cdiv(m, block_m))](
        x_arg, x_scale, w_arg, w_scale, gated, amax, m, inter, k, xq.stride(0), weight.stride(0), gated.stride(0),
        amax.stride(0), TMA=tma, IMPRECISE=cfg.block_k, BM=block_m, BN=cfg.block_n, BK=cfg.block_k, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(pdl))
    return quantize_parts(gated, amax)
