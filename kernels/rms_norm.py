"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm(x + residual) * weight, x + residual)``.

    The second value is the new residual stream; with ``residual=None`` it is ``x``.
    Math runs in float32 and the result is cast back to ``x.dtype``.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    out = (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return out, x


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_ref(x, weight, eps, residual)
