"""GPTQ: 8-bit weights rounded one input column at a time, each column's rounding error spread over
the columns not yet rounded, weighted by how the calibration inputs correlate them.

Round to nearest makes each weight's error as small as it can be alone; what a projection is
judged by is the error of its output, ``(W - Q) @ x`` over the inputs it sees. With ``H`` the
inputs' second moment (``2/n * X.T @ X``), the error a rounded column leaves can be cancelled in
part by moving the columns after it, by the corresponding row of ``H``'s inverse (Frantar et
al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers").
e4m3's three mantissa bits round every weight by up to 1/16 of itself whatever the scale, so
there this is what buys the quality back (docs/benchmarks).

The format is :func:`pd_cluster.model.quant_linear.quantize`'s: one scale an output channel,
fixed before any column moves, symmetric codes; the kernels read the result as they read any
8-bit weight. int8's scale is its amax over 127. fp8's leaves a binade of headroom (amax over
224, not 448): the errors moved onto later columns push some of them past the channel's amax, and
a code clamped at e4m3's largest value leaves an error no later column takes. e4m3 is a float
format, so the headroom costs no precision but at the bottom of the range (values below 1/14336
of the amax become subnormal); on the default model 0.08% of the codes clamped at amax over
448, none at 224, and the perplexity cost went 1.020x -> 1.018x (docs/benchmarks).
"""

from __future__ import annotations

import torch

from pd_cluster.model.quant_linear import FP8, QMAX, QuantLinear
from pd_cluster.quantize.options import BLOCK, DAMP

#: How many times its amax a channel's fp8 scale can hold (see the module's docstring).
FP8_HEADROOM = 2.0


def _round(columns: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """The codes of ``columns`` ``[N, c]`` under ``scale`` ``[N, 1]``, as float32 values."""
    scaled = columns / scale
    if method == "int8":
        return scaled.round().clamp(-127, 127)
    return scaled.clamp(-448.0, 448.0).to(FP8).float()


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, in float64."""
    h = hessian.double().clone()
    idx = torch.arange(h.shape[0], device=h.device)
    h[idx, idx] += damp * h.diagonal().mean().clamp_min(1e-12)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, method: str = "fp8", damp: float = DAMP,
                  block: int = BLOCK, act_order: bool = False) -> QuantLinear:
    """``weight`` ``[N, K]`` as 8-bit codes with a scale an output channel, rounded by GPTQ over
    ``hessian`` ``[K, K]`` (the inputs' second moment). Inputs that never fired (a zero diagonal)
    have their weights rounded as they are: nothing can be learned about them. ``act_order``:
    the columns of the largest inputs first, while the most columns are left to take their
    error (the scales are fixed before, so the order changes nothing of the format)."""
    if method not in QMAX:
        raise ValueError(f"quantization {method!r}; expected one of {tuple(QMAX)}")
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"a Hessian of {k} x {k} inputs expected, not {tuple(hessian.shape)}")
    w = weight.float().clone()
    amax = w.abs().amax(dim=1, keepdim=True)
    largest = QMAX[method] / FP8_HEADROOM if method == "fp8" else QMAX[method]
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    h = hessian.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    order = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if order is not None:
        w, h = w[:, order], h[order][:, order]
    upper = _inverse_cholesky(h, damp).float()
    codes = torch.empty_like(w)
    for start in range(0, k, block):
        stop = min(start + block, k)
        part = w[:, start:stop].clone()
        errors = torch.empty_like(part)
        u = upper[start:stop, start:stop]
        for i in range(stop - start):
            q = _round(part[:, i:i + 1], scale, method)
            codes[:, start + i] = q[:, 0]
            err = (part[:, i] - q[:, 0] * scale[:, 0]) / u[i, i]
            part[:, i:] -= err[:, None] * u[i, i:][None, :]
            errors[:, i] = err
        w[:, stop:] -= errors @ upper[start:stop, stop:]
    if order is not None:
        codes = codes[:, torch.argsort(order)]
    dtype = torch.int8 if method == "int8" else FP8
    return QuantLinear(codes.to(dtype).contiguous(), scale[:, 0].contiguous())
