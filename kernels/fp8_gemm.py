"""A GEMM of float8 activations by float8 weights for decode batches of a few dozen rows.

At 17 to 64 rows a decode step still reads its weights and little else: the product is some
2 * rows FLOP a weight byte, far below what the FP8 tensor cores do in the time its byte takes
to arrive. What bounds it is how many weight bytes each SM keeps in flight. This kernel tiles the
output by all the rows (one ``BLOCK_M`` tile) and ``BLOCK_N`` channels and streams ``BLOCK_K``
inputs a stage through ``num_stages`` buffers; where a narrow output leaves fewer tiles than the
GPU has SMs, the inputs split ``split_k`` ways, each part's float32 sums written apart and added
in a fixed order by a second kernel (the same sums every run, no atomics).

``tma`` loads the tiles by tensor descriptor (sm_90).

The numbers are ``torch._scaled_mm``'s: the activations quantized per row
(:func:`kernels.quant_matmul.act_quant_fp8_triton`), the weight per output channel, both scales
applied to the float32 sums. Hopper's FP8 products add up in fewer bits than float32; the partial
sums are promoted to float32 every ``BLOCK_K`` inputs, as cuBLAS does without fast accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import (
    capability,
    cdiv,
    last_dim_contiguous,
    next_pow2,
    pdl_options,
    pdl_wait,
    require_triton,
    shared_memory_limit,
    tl,
    triton,
    use_pdl,
)

from kernels._rotary_epilogue import pair_columns, store_qkv_tile
from kernels.qkv_epilogue import QkvRotary, split_sum_rotary

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no Triton, or one without host-side tensor descriptors: the pointer loads
    TensorDescriptor = None


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles and launch options of :func:`fp8_gemm_triton`."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    #: Tiles loaded by tensor descriptor (TMA) rather than by pointers.
    tma: bool = False

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} k{self.split_k} w{self.num_warps} "
                f"s{self.num_stages}{' tma' if self.tma else ''}")


#: Configs by (rows' power of two, out features, in features), as measured fastest on an H200
#: (``pd_cluster.bench.gpu.fp8_gemm_sweep``); other shapes take :func:`fp8_gemm_heuristic`.
FP8_GEMM_CONFIGS: dict[tuple[int, int, int], Fp8GemmConfig] = {
    # One H200, the 8B shape's projections after the activations' quantization, each in a CUDA graph
    # over cold weights (``fp8-decode-sweep-nvidia-h200-x1-2026-11-29.json``); a layer's four at 64
    # rows 85.8 us against _scaled_mm's 125.5 and cuBLAS bf16's 127.3, at 16 rows 87.2 against the
    # weight-only GEMM's 113.2. At 64 rows o and gate/up load by descriptor (``fp8_gemm_sweep``,
    # the same day: 9.37 against 9.70 us, 35.59 against 37.25), down too (even: 24.42, 24.48).
    # 2026-11-30, more stages in flight at 64 rows (the same timing): qkv five, o seven (8.98 ->
    # 8.78 us), down eight over 32 channels a tile, unsplit (22.23 -> 20.74, its split sum gone).
    (16, 6144, 4096): Fp8GemmConfig(16, 64, 256, 4, 4, 4),  # qkv 11.88 us
    (32, 6144, 4096): Fp8GemmConfig(32, 64, 256, 4, 4, 4),  # 14.40
    (64, 6144, 4096): Fp8GemmConfig(64, 64, 256, 1, 4, 5),
    (16, 4096, 14336): Fp8GemmConfig(16, 64, 256, 4, 4, 4),  # down 29.11
    (32, 4096, 14336): Fp8GemmConfig(32, 64, 256, 4, 4, 4),  # 32.82
    (64, 4096, 14336): Fp8GemmConfig(64, 32, 256, 1, 4, 8, tma=True),  # 20.74
    (16, 4096, 4096): Fp8GemmConfig(16, 64, 256, 4, 4, 4),  # o 10.89
    (32, 4096, 4096): Fp8GemmConfig(32, 64, 256, 4, 4, 4),  # 12.96
    (64, 4096, 4096): Fp8GemmConfig(64, 32, 256, 1, 4, 7, tma=True),  # 8.78
    (16, 28672, 4096): Fp8GemmConfig(16, 32, 256, 1, 4, 5),  # gate_up 35.29
    (32, 28672, 4096): Fp8GemmConfig(32, 64, 256, 1, 4, 3),  # 35.86
    (64, 28672, 4096): Fp8GemmConfig(64, 128, 128, 1, 4, 4, tma=True),  # 35.59
}

#: Rows up to which FP8 weights take this GEMM rather than ``torch._scaled_mm`` (past the
#: weight-only GEMM's rows, ``kernels.quant_matmul.FP8_WEIGHT_ONLY_MAX_ROWS``): measured to 64.
FP8_GEMM_MAX_ROWS = 64
#: SMs the tiles should cover (an H100 or H200 has 132).
TARGET_PROGRAMS = 128


def fp8_gemm_heuristic(rows: int, n: int, k: int) -> Fp8GemmConfig:
    """One row tile (up to 64 rows; more rows more tiles) by 64 channels over blocks of 128
    inputs, four stages (64 KiB of shared memory); the inputs split so that the tiles number at
    least :data:`TARGET_PROGRAMS`, each part at least 1024 inputs long."""
    bm = min(64, max(16, next_pow2(rows)))
    bn, bk = 64, 128
    tiles = cdiv(n, bn) * cdiv(rows, bm)
    split = 1
    while tiles * split < TARGET_PROGRAMS and k // (2 * split) >= 1024:
        split *= 2
    return Fp8GemmConfig(bm, bn, bk, split, 4, 4)


def shared_bytes(cfg: Fp8GemmConfig) -> int:
    """Shared memory ``cfg``'s stages hold: a row tile and a weight tile of float8 codes each."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k


def fp8_gemm_config(rows: int, n: int, k: int, device: torch.device | None = None) -> Fp8GemmConfig:
    """:data:`FP8_GEMM_CONFIGS`' entry where ``device`` (a GPU) has the shared memory it takes
    (the entries are an H200's, up to 192 KiB a program), else the heuristic."""
    cfg = FP8_GEMM_CONFIGS.get((next_pow2(rows), n, k))
    if cfg is not None and device is not None and device.type == "cuda":
        limit = shared_memory_limit(device)
        if limit is not None and shared_bytes(cfg) > limit:
            cfg = None
    return cfg or fp8_gemm_heuristic(rows, n, k)


def _splits(cfg: Fp8GemmConfig, k: int) -> tuple[int, int]:
    """(parts, inputs a part) of ``k`` inputs under ``cfg``: whole blocks a part, no part empty."""
    split = max(1, min(cfg.split_k, cdiv(k, cfg.block_k)))
    k_part = cdiv(cdiv(k, split), cfg.block_k) * cfg.block_k
    return cdiv(k, k_part), k_part


def rotary_epilogue_fits(rows: int, n: int, k: int, head_dim: int, config: Fp8GemmConfig | None = None) -> bool:
    """Whether :func:`fp8_gemm_triton` finishes a qkv projection of heads of ``head_dim`` itself
    (``rotary``): split products always (the parts' sum does it a head at a time); whole ones where
    a tile holds whole rotary pairs."""
    cfg = config or fp8_gemm_config(rows, n, k)
    return head_dim % 2 == 0 and (_splits(cfg, k)[0] > 1 or (head_dim // 2) % max(1, cfg.block_n // 2) == 0)


@triton.jit
def _fp8_gemm_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, k_part,
                     stride_x, stride_w, stride_out, stride_part,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IMPRECISE: tl.constexpr, TMA: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr,
                     pos_ptr=None, slots_ptr=None, cos_ptr=None, sin_ptr=None, k_cache_ptr=None, v_cache_ptr=None,
                     stride_cos=0, stride_sin=0, stride_ks=0, stride_kh=0, stride_vs=0, stride_vh=0,
                     NUM_Q_HEADS=0, QK_HEADS=0, V_COLS=0, ROTARY: tl.constexpr = False,
                     STORE_KV: tl.constexpr = False, HEAD_DIM: tl.constexpr = 2):
    # Program: a BM x BN tile of the output over inputs [pid_k * k_part, (pid_k + 1) * k_part).
    # TMA: x_ptr and w_ptr are tensor descriptors ([M, K] by [BM, BK]; [N, K] by [BN, BK]).
    # ROTARY (a qkv projection, not split): the tile's columns are pair_columns', finished by
    # store_qkv_tile (kernels._rotary_epilogue); the weight rows load by pointer.
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    if ROTARY:
        rn = pair_columns(pid_n, QK_HEADS, HEAD_DIM, BN)
    else:
        rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    k_start = pid_k * k_part
    k_end = tl.minimum(k_start + k_part, K)
    if not TMA:
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
        w_rows = w_ptr + rn[None, :].to(tl.int64) * stride_w
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        if TMA:
            a = x_ptr.load([pid_m * BM, k0])
            w = w_ptr.load([pid_n * BN, k0]).T
        else:
            k_mask = (k0 + rk) < k_end
            a = tl.load(x_rows + k0 + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + k0 + rk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=IMPRECISE)
    if SPLIT:
        part = out_ptr + pid_k * stride_part + rm[:, None].to(tl.int64) * stride_out + rn[None, :]
        tl.store(part, acc, mask=m_mask[:, None] & n_mask[None, :])
    else:
        acc *= tl.load(x_scale_ptr + rm, mask=m_mask, other=0.0)[:, None]
        acc *= tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ROTARY:
            store_qkv_tile(acc, rm, m_mask, pid_n, out_ptr, pos_ptr, slots_ptr, cos_ptr, sin_ptr, k_cache_ptr,
                           v_cache_ptr, stride_out, stride_cos, stride_sin, stride_ks, stride_kh, stride_vs, stride_vh,
                           NUM_Q_HEADS, QK_HEADS, V_COLS, HEAD_DIM, BM, BN, STORE_KV)
        else:
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_part, stride_out,
                      HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Program: BLOCK outputs of one row, the parts added in their order, then scaled.
    pdl_wait(USE_PDL)
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * stride_part + row * N + cols, mask=mask, other=0.0)
    acc = acc * tl.load(x_scale_ptr + row) * tl.load(w_scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def describable(t: torch.Tensor) -> bool:
    """Whether ``t`` (2-D, rows contiguous) can be a tensor descriptor's."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] % 16 == 0


def sm90(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device may load by tensor descriptor: sm_90 and newer (an
    interpreted kernel, on the CPU, runs them anywhere)."""
    return not t.is_cuda or capability(t.device) >= (9, 0)


def fp8_gemm_triton(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                    config: Fp8GemmConfig | None = None, rotary: QkvRotary | None = None) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * w_scale[:, None]).T (+ bias)`` in ``out_dtype``: ``xq``
    ``[M, K]`` float8 e4m3 codes with one float32 scale a row (``[M]`` or ``[M, 1]``),
    ``weight`` ``[N, K]`` float8 e4m3 with one float32 scale an output channel. ``rotary``: the
    product is a qkv projection, finished here (rotary embedding, the KV store; what it returns
    then: :class:`kernels.qkv_epilogue.QkvRotary`)."""
    require_triton()
    xq = last_dim_contiguous(xq)
    weight = last_dim_contiguous(weight)
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} input features, the input {k}")
    if xq.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"float8 e4m3 operands, not {xq.dtype} and {weight.dtype}")
    x_scale = x_scale.reshape(-1).contiguous()
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (n,) or x_scale.dtype != torch.float32 \
            or x_scale.numel() != m:
        raise ValueError("float32 scales, one a row and one an output channel")
    if rotary is not None:
        rotary.check(n, out_dtype)
    out = rotary.out(m, n, out_dtype, xq.device) if rotary is not None else \
        torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = config or fp8_gemm_config(m, n, k, xq.device)
    split, k_part = _splits(cfg, k)
    if rotary is not None and not rotary_epilogue_fits(m, n, k, rotary.head_dim, cfg):
        raise ValueError(f"tiles of {cfg.block_n} columns split a rotary pair of heads of {rotary.head_dim}")
    grid = (cdiv(n, cfg.block_n), cdiv(m, cfg.block_m), split)
    target = torch.empty((split, m, n), dtype=torch.float32, device=xq.device) if split > 1 else out
    pdl = use_pdl(xq)  # each launch waits for the one before at its start
    # A rotary tile's weight rows are no block: loaded by pointers.
    tma = cfg.tma and sm90(xq) and TensorDescriptor is not None and describable(xq) and describable(weight)
    epilogue = rotary is not None and split == 1
    if epilogue:
        tma = False
        grid = (rotary.num_heads + rotary.num_kv_heads) * rotary.head_dim // cfg.block_n \
            + cdiv(rotary.num_kv_heads * rotary.head_dim, cfg.block_n), grid[1], grid[2]
    x_arg = TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k]) if tma else xq
    w_arg = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]) if tma else weight
    extra = dict(zip(_ROTARY_ARGS, rotary.kernel_args(out)), ROTARY=True, STORE_KV=rotary.store_kv,
                 HEAD_DIM=rotary.head_dim) if epilogue else {}
    _fp8_gemm_kernel[grid](
        x_arg, x_scale, w_arg, w_scale, bias if bias is not None else w_scale, target, m, n, k, k_part,
        xq.stride(0), weight.stride(0), n if split > 1 else out.stride(0), m * n,
        HAS_BIAS=bias is not None, SPLIT=split > 1, IMPRECISE=cfg.block_k, TMA=tma,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, USE_PDL=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **extra, **pdl_options(pdl))
    if split > 1 and rotary is not None:
        split_sum_rotary(target, x_scale, w_scale, bias, out, rotary)
    elif split > 1:
        block = min(1024, next_pow2(n))
        _split_sum_kernel[(cdiv(n, block), m)](target, x_scale, w_scale, bias if bias is not None else w_scale, out,
                                               m, n, m * n, out.stride(0), HAS_BIAS=bias is not None, SPLITS=split,
                                               BLOCK=block, USE_PDL=pdl, num_warps=4, **pdl_options(pdl))
    return out


#: The rotary epilogue's kernel arguments, in :meth:`QkvRotary.kernel_args`' order.
_ROTARY_ARGS = ("pos_ptr", "slots_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr", "v_cache_ptr", "stride_cos",
                "stride_sin", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "NUM_Q_HEADS", "QK_HEADS", "V_COLS")
