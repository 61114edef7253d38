"""GPTQ's rounding against round to nearest: the same codes where inputs are uncorrelated (or
never fire), a smaller output error where they are correlated, and the scales' format unchanged
(fp8's with a binade of headroom: each channel's amax at code 224)."""

from __future__ import annotations

import pytest
import torch

from pd_cluster.model.quant_linear import FP8, QMAX, quantize
from pd_cluster.quantize.gptq import FP8_HEADROOM, gptq_quantize


def _weight(n: int = 48, k: int = 160, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]


def _correlated_inputs(k: int, rows: int = 2048, seed: int = 1) -> torch.Tensor:
    """Inputs in a few shared directions plus noise, as a layer's activations are."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, k, generator=gen)
    return torch.randn(rows, 8, generator=gen) @ basis + 0.05 * torch.randn(rows, k, generator=gen)


def _moment(x: torch.Tensor) -> torch.Tensor:
    return 2.0 / x.shape[0] * x.T @ x


def _output_error(weight: torch.Tensor, q, x: torch.Tensor) -> float:
    return float(((weight - q.dequantize(torch.float32)) @ x.T).norm())


def _nearest(weight: torch.Tensor, method: str):
    """Round to nearest under GPTQ's scales: ``quantize``'s for int8; for fp8 twice those (the
    headroom), each weight rounded alone."""
    rtn = quantize(weight, method)
    if method == "int8":
        return rtn.qweight, rtn.scale
    scale = rtn.scale * FP8_HEADROOM
    return (weight / scale[:, None]).to(FP8), scale


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_uncorrelated_inputs_give_the_codes_of_rounding_to_nearest(method):
    w = _weight()
    q = gptq_quantize(w, torch.eye(w.shape[1]) * 3.0, method)
    codes, scale = _nearest(w, method)
    assert torch.equal(q.qweight.view(torch.int8), codes.view(torch.int8)) and torch.equal(q.scale, scale)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_correlated_inputs_leave_a_smaller_output_error_than_rounding_to_nearest(method, act_order):
    w = _weight()
    x = _correlated_inputs(w.shape[1])
    q = gptq_quantize(w, _moment(x), method, damp=0.01, act_order=act_order)
    rtn = quantize(w, method)
    gptq_error, rtn_error = _output_error(w, q, x), _output_error(w, rtn, x)
    assert gptq_error < 0.5 * rtn_error, (gptq_error, rtn_error)
    # The format is round to nearest's: its scales (fp8's with the headroom), codes within the range.
    assert torch.equal(q.scale, _nearest(w, method)[1]) and q.qweight.dtype == rtn.qweight.dtype
    assert float(q.qweight.float().abs().max()) <= QMAX[method]


@pytest.mark.parametrize("act_order", [True, False])
def test_an_input_that_never_fired_keeps_its_weights_rounded_to_nearest(act_order):
    w = _weight()
    x = _correlated_inputs(w.shape[1])
    x[:, 7] = 0.0
    moment = _moment(x)
    q = gptq_quantize(w, moment, "fp8", damp=0.01, act_order=act_order)
    nearest = _nearest(w, "fp8")[0].view(torch.int8)
    codes = q.qweight.view(torch.int8)
    # The first column rounded (the largest input's, by act order) is rounded before any moves.
    first = int(moment.diagonal().argmax()) if act_order else 0
    assert torch.equal(codes[:, first], nearest[:, first])
    assert torch.equal(codes[:, 7], nearest[:, 7])
    assert not torch.equal(codes, nearest)


def test_fp8_codes_pushed_past_the_amax_are_not_clamped():
    """Correlated inputs move errors onto later columns, past some channels' amax: with the
    headroom no code reaches e4m3's largest value, and at a scale of amax over 448 some would have."""
    w = _weight()
    x = _correlated_inputs(w.shape[1])
    q = gptq_quantize(w, _moment(x), "fp8", damp=0.01)
    dequantized = q.dequantize(torch.float32)
    assert float(q.qweight.float().abs().max()) < QMAX["fp8"]
    assert bool((dequantized.abs() > w.abs().amax(dim=1, keepdim=True)).any())


def test_a_moment_of_other_inputs_or_an_unknown_format_is_refused():
    w = _weight()
    with pytest.raises(ValueError, match="160 x 160"):
        gptq_quantize(w, torch.eye(100))
    with pytest.raises(ValueError, match="int4"):
        gptq_quantize(w, torch.eye(160), "int4")
