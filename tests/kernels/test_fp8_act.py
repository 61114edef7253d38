"""RMSNorm and the SiLU gate writing FP8 codes (:mod:`kernels.fp8_act`) against the unfused kernels
followed by the activation quantization, run by Triton's interpreter; the model's fused
norm/gate-then-projection helpers against the unfused path.

As in ``test_kernels_triton.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported:
with it set the interpreted cases are collected, else one test runs this file in a child pytest
with the variable set. The interpreter truncates to bfloat16 where the GPU rounds, so against the
torch references the codes may be a code apart; against the unfused Triton kernels, which round
the same way here, they are equal.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_act import (
    rms_norm_quant_fp8_ref,
    rms_norm_quant_fp8_triton,
    silu_mul_quant_fp8_ref,
    silu_mul_quant_fp8_triton,
)
from kernels.fp8_gated import GatedConfig, fp8_gate_up_silu_triton
from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_triton
from kernels.quant_matmul import act_quant_fp8_ref, act_quant_fp8_triton
from kernels.rms_norm import rms_norm_triton
from kernels.silu_mul import silu_mul_triton
from pd_cluster.model import fp8_fused
from pd_cluster.model.quant_linear import quantize
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_codes_near(q: torch.Tensor, ref_q: torch.Tensor) -> None:
    """Against the torch references: codes at most one apart but for a few. The interpreter's
    e4m3 conversion drops carries and truncates (``test_kernels_triton``), and its bfloat16
    roundings truncate too, so a few codes land further off (120 -> 64); the GPU test compares
    them exactly."""
    apart = (q.view(torch.int8).int() - ref_q.view(torch.int8).int()).abs()
    assert (apart > 1).float().mean() < 0.03
    assert (apart > 0).float().mean() < 0.15


class InterpretedCases:
    @pytest.mark.parametrize("with_residual", [False, True])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_rms_norm_codes_are_the_unfused_kernels(self, dtype: torch.dtype, with_residual: bool) -> None:
        gen = torch.Generator().manual_seed(31)
        x = (torch.randn(7, 200, generator=gen) * 2).to(dtype)
        x[3] = 0  # a row of zeros: finite scale, zero codes
        residual = torch.randn(7, 200, generator=gen).to(dtype) if with_residual else None
        if residual is not None:
            residual[3] = 0
        weight = (torch.rand(200, generator=gen) + 0.5).to(dtype)
        codes, scale, new_residual = rms_norm_quant_fp8_triton(x, weight, 1e-5, residual)
        normed, want_residual = rms_norm_triton(x, weight, 1e-5, residual)
        want_codes, want_scale = act_quant_fp8_triton(normed)
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (7, 1)
        assert torch.equal(codes.view(torch.int8), want_codes.view(torch.int8))
        assert torch.equal(scale, want_scale)
        assert torch.equal(new_residual, want_residual)
        assert torch.equal(codes[3].float(), torch.zeros(200)) and bool(torch.isfinite(scale).all())
        ref_codes, ref_scale, ref_residual = rms_norm_quant_fp8_ref(x, weight, 1e-5, residual)
        assert_codes_near(codes, ref_codes)
        torch.testing.assert_close(scale, ref_scale, rtol=2e-2 if dtype == torch.bfloat16 else 1e-3, atol=0)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_silu_codes_are_the_unfused_kernels(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(32)
        # One block (300 outputs), blocks of 128 (a partial one: amax, then codes), the defaults (one
        # block; past 16384 blocks of 2048).
        for cols, block in ((300, None), (300, 128), (9000, None), (17000, None)):
            gate_up = (torch.randn(5, 2 * cols, generator=gen) * 3).to(dtype)
            gate_up[1] = 0
            codes, scale = silu_mul_quant_fp8_triton(gate_up, block=block)
            want_codes, want_scale = act_quant_fp8_triton(silu_mul_triton(gate_up))
            assert torch.equal(codes.view(torch.int8), want_codes.view(torch.int8))
            assert torch.equal(scale, want_scale)
            ref_codes, _ = silu_mul_quant_fp8_ref(gate_up)
            assert_codes_near(codes, ref_codes)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_silu_codes_over_parts_of_rows_are_one_program_a_rows(self, dtype: torch.dtype) -> None:
        """Two launches over parts of 1024 columns (the gated values and each part's amax, then the
        codes): every code and scale as one program a row writes them, a last part reaching past
        the row's end and a row whose largest value lies in one part alone included."""
        gen = torch.Generator().manual_seed(35)
        for cols in (300, 1024, 2500):
            gate_up = (torch.randn(6, 2 * cols, generator=gen) * 3).to(dtype)
            gate_up[1] = 0
            gate_up[2, cols - 1] = 40.0  # the row's amax in its last part
            gate_up[2, 2 * cols - 1] = 40.0
            got_codes, got_scale = silu_mul_quant_fp8_triton(gate_up, parts=True)
            want_codes, want_scale = silu_mul_quant_fp8_triton(gate_up, parts=False)
            assert torch.equal(got_codes.view(torch.int8), want_codes.view(torch.int8))
            assert torch.equal(got_scale, want_scale)
            assert got_scale[2].item() > 1.5 * got_scale[3].item()  # the lone large value set row 2's scale

    def test_empty_inputs(self) -> None:
        codes, scale, residual = rms_norm_quant_fp8_triton(torch.zeros(0, 64), torch.ones(64), 1e-5)
        assert codes.shape == (0, 64) and scale.shape == (0, 1) and residual.shape == (0, 64)
        codes, scale = silu_mul_quant_fp8_triton(torch.zeros(0, 128))
        assert codes.shape == (0, 64) and scale.shape == (0, 1)

    def test_mixed_dtypes_are_refused(self) -> None:
        with pytest.raises(ValueError, match="dtype"):
            rms_norm_quant_fp8_triton(torch.zeros(2, 64, dtype=torch.bfloat16), torch.ones(64), 1e-5)

    @pytest.mark.parametrize("with_bias", [False, True])
    def test_fused_helpers_match_the_unfused_product(self, monkeypatch: pytest.MonkeyPatch, with_bias: bool) -> None:
        """Forced onto the fused path (off a GPU it never runs): the same product as the unfused
        kernels' codes through the same scaled product."""
        gen = torch.Generator().manual_seed(33)
        hidden, residual = torch.randn(2, 40, 64, generator=gen).half(), torch.randn(2, 40, 64, generator=gen).half()
        norm_w = (torch.rand(64, generator=gen) + 0.5).half()
        weight = quantize(torch.randn(96, 64, generator=gen) * 0.1, "fp8")
        down = quantize(torch.randn(64, 48, generator=gen) * 0.1, "fp8")
        bias = torch.randn(96, generator=gen).half() if with_bias else None
        monkeypatch.setattr(fp8_fused, "fused_fp8", lambda x, w: True)
        out, new_residual = fp8_fused.norm_then_linear(hidden, residual, norm_w, 1e-5, weight, bias)
        normed, want_residual = rms_norm_triton(hidden, norm_w, 1e-5, residual)
        want = fp8_fused.scaled_product(*act_quant_fp8_triton(normed.reshape(80, 64)), weight, torch.float16, bias)
        assert out.shape == (2, 40, 96) and torch.equal(out, want.reshape(2, 40, 96))
        assert torch.equal(new_residual, want_residual)
        gate_up = out[..., :96]
        got = fp8_fused.silu_then_linear(gate_up, down)
        codes, scale = act_quant_fp8_triton(silu_mul_triton(gate_up).reshape(80, 48))
        assert got.shape == (2, 40, 64) and torch.equal(got, fp8_fused.scaled_product(codes, scale, down,
                                                                                      torch.float16).reshape(2, 40, 64))

    @pytest.mark.parametrize("tma", [False, True])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_gate_up_gated_in_its_epilogue_writes_the_unfused_codes(self, dtype: torch.dtype, tma: bool) -> None:
        """37 rows, 2 x 80 gate/up channels (a partial tile of 32 gated outputs), 96 inputs (a
        partial block of 64): the codes and scales of the gate/up GEMM's output gated and quantized
        after it, bit for bit, the gate's and the up's channels at their places in the fused weight."""
        gen = torch.Generator().manual_seed(41)
        xq, x_scale = act_quant_fp8_ref(torch.randn(37, 96, generator=gen))
        weight = (torch.randn(160, 96, generator=gen) * 448 / 3).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_scale = torch.rand(160, generator=gen) * 2e-3 + 1e-4
        codes, scale = fp8_gate_up_silu_triton(xq, x_scale, weight, w_scale, dtype, GatedConfig(32, 64, tma=tma))
        gate_up = fp8_gemm_triton(xq, x_scale, weight, w_scale, dtype, config=Fp8GemmConfig(64, 32, 64))
        want_codes, want_scale = silu_mul_quant_fp8_triton(gate_up)
        assert codes.shape == (37, 80) and scale.shape == (37, 1)
        assert torch.equal(scale, want_scale)
        assert torch.equal(codes.view(torch.int8), want_codes.view(torch.int8))

    def test_gate_up_gated_refuses_a_weight_that_is_no_gate_up(self) -> None:
        xq, x_scale = act_quant_fp8_ref(torch.randn(4, 32))
        weight = torch.zeros(15, 32).to(torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="gate/up"):
            fp8_gate_up_silu_triton(xq, x_scale, weight, torch.ones(15), torch.float16)

    def test_fused_mlp_is_the_unfused_helpers(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Forced onto the fused path: the MLP through the gated GEMM gives the output and residual
        of norm_then_linear into gate/up and silu_then_linear into down."""
        gen = torch.Generator().manual_seed(43)
        hidden, residual = torch.randn(40, 64, generator=gen).half(), torch.randn(40, 64, generator=gen).half()
        norm_w = (torch.rand(64, generator=gen) + 0.5).half()
        gate_up = quantize(torch.randn(96, 64, generator=gen) * 0.1, "fp8")
        down = quantize(torch.randn(64, 48, generator=gen) * 0.1, "fp8")
        monkeypatch.setattr(fp8_fused, "fused_fp8", lambda x, w: True)
        out, new_residual = fp8_fused.norm_gate_up_silu_down_fp8(hidden, residual, norm_w, 1e-5, gate_up, down)
        up_out, want_residual = fp8_fused.norm_then_linear(hidden, residual, norm_w, 1e-5, gate_up)
        want = fp8_fused.silu_then_linear(up_out, down)
        assert out.shape == (40, 64) and torch.equal(out, want) and torch.equal(new_residual, want_residual)
        assert fp8_fused.norm_gate_up_silu_down_fp8(hidden, residual, norm_w, 1e-5, gate_up, gate_up) is None


def test_fused_path_only_for_scaled_products() -> None:
    """Off a GPU, with float weights, or with int8 ones the plain ops run (no scaled product)."""
    x = torch.randn(300, 64)
    assert not fp8_fused.fused_fp8(x, quantize(torch.randn(96, 64), "fp8"))
    assert not fp8_fused.fused_fp8(x, torch.randn(96, 64))
    assert not fp8_fused.fused_fp8(x, quantize(torch.randn(96, 64), "int8"))
    out, residual = fp8_fused.norm_then_linear(x, None, torch.ones(64), 1e-5, torch.eye(64))
    assert torch.equal(residual, x) and out.shape == (300, 64)


if INTERPRETER:
    TestFp8ActInterpreted = InterpretedCases
else:

    def test_fp8_activation_kernels_match_in_the_interpreter() -> None:
        run_in_interpreter(__file__, min_passed=10)
