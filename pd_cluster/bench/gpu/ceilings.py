"""The ceilings every figure is a ratio against, measured in the same run on random data."""

from __future__ import annotations

import torch

from pd_cluster.bench.gpu.timing import cuda_ms, empty_cache


def measure_ceilings(device: torch.device) -> dict:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate, on random data."""
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
    empty_cache()
    return {
        "copy_bytes": 2 * 2 * n,
        "copy_ms": copy_ms,
        "copy_tb_per_s": 2 * 2 * n / copy_ms / 1e9,
        "matmul_shape": [m, m, m],
        "matmul_ms": mm_ms,
        "matmul_tflops": 2 * m**3 / mm_ms / 1e9,
    }
