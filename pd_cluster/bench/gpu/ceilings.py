"""The ceilings every figure is a ratio against, measured in the same run on random data."""

from __future__ import annotations

import logging

import torch

from pd_cluster.bench.gpu.timing import cuda_ms, empty_cache
from pd_cluster.model.quant_linear import FP8

logger = logging.getLogger(__name__)


def measure_ceilings(device: torch.device) -> dict:
    """Device copy bandwidth (bytes read + written), the bf16 matmul rate and, where the device
    has FP8 products, the FP8 one, on random data."""
    n = 1 << 30 if device.type == "cuda" else 1 << 22  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), device, reps=20)
    del src, dst
    m = 8192 if device.type == "cuda" else 512
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mm_ms = cuda_ms(lambda: torch.mm(a, b), device, warmup=5, reps=20)
    del a, b
    fp8_ms = fp8_matmul_ms(device, m)
    empty_cache()
    return {
        "copy_bytes": 2 * 2 * n,
        "copy_ms": copy_ms,
        "copy_tb_per_s": 2 * 2 * n / copy_ms / 1e9,
        "matmul_shape": [m, m, m],
        "matmul_ms": mm_ms,
        "matmul_tflops": 2 * m**3 / mm_ms / 1e9,
        "fp8_matmul_ms": fp8_ms,
        "fp8_matmul_tflops": None if fp8_ms is None else 2 * m**3 / fp8_ms / 1e9,
    }


def fp8_matmul_ms(device: torch.device, m: int) -> float | None:
    """An ``m``-cubed ``torch._scaled_mm`` of float8 (e4m3) operands with row-wise scales (a scale
    per input row and per weight channel, bf16 out), as the FP8 projections run their products;
    None where the device has no such product (a CPU, a GPU before compute capability 9.0)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    try:
        x = torch.randn(m, m, device=device).to(FP8)
        weight = torch.randn(m, m, device=device).to(FP8)  # [out, in], as a projection holds it
        x_scale = torch.rand(m, 1, device=device) + 0.5
        w_scale = torch.rand(1, m, device=device) + 0.5
        return cuda_ms(lambda: torch._scaled_mm(x, weight.t(), scale_a=x_scale, scale_b=w_scale,
                                                out_dtype=torch.bfloat16), device, warmup=5, reps=20)
    except RuntimeError as e:  # a build of torch without row-wise scaled products
        logger.warning("no FP8 matmul rate: %s", e)
        return None
