"""The FP8 GEMM of decode batches (:mod:`kernels.fp8_gemm`, split-K included) against the scaled
product, run by Triton's interpreter.

As in ``test_kernels_triton.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported:
with it set the interpreted cases are collected, else one test runs this file in a child pytest.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_heuristic, fp8_gemm_triton
from kernels.quant_matmul import act_quant_fp8_ref
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter

FP8 = torch.float8_e4m3fn


def _codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 448 / 3).clamp(-448, 448).to(FP8)


class InterpretedCases:
    @pytest.mark.parametrize("config", [Fp8GemmConfig(16, 32, 64), Fp8GemmConfig(32, 16, 32, split_k=3),
                                        Fp8GemmConfig(16, 64, 32, split_k=2, num_stages=2), None])
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
    def test_fp8_gemm_matches_the_scaled_product(self, config: Fp8GemmConfig | None, out_dtype: torch.dtype) -> None:
        """37 rows (a partial row tile), 70 outputs (a partial channel tile), 200 inputs (a partial
        block; split three ways: parts of 96, 96 and 8); with and without a bias. The reference
        multiplies the same codes in float64: the kernel differs by float32 sums and the output's
        rounding."""
        gen = torch.Generator().manual_seed(33)
        x = torch.randn(37, 200, generator=gen) * 2
        xq, x_scale = act_quant_fp8_ref(x)
        weight, w_scale = _codes(70, 200, gen), torch.rand(70, generator=gen) * 2e-3 + 1e-4
        bias = torch.randn(70, generator=gen)
        ref = (xq.double() * x_scale.double()) @ (weight.double() * w_scale.double()[:, None]).T
        for b in (None, bias):
            out = fp8_gemm_triton(xq, x_scale, weight, w_scale, out_dtype, b.to(out_dtype) if b is not None else None,
                                  config)
            want = ref + b.double() if b is not None else ref
            rtol = 1e-6 if out_dtype == torch.float32 else 1e-3
            assert out.dtype == out_dtype and not torch.isnan(out).any()
            torch.testing.assert_close(out.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())

    @pytest.mark.parametrize("config", [Fp8GemmConfig(64, 32, 64, tma=True), Fp8GemmConfig(64, 16, 32, 3, tma=True),
                                        Fp8GemmConfig(64, 32, 64, 2, tma=True)])
    def test_fp8_gemm_by_descriptors(self, config: Fp8GemmConfig) -> None:
        """Tiles loaded by tensor descriptor (rows and outputs past the tiles' ends read as
        zeros; 256 inputs split in parts of 96, 96 and 64): the same bits as the pointer loads' tiles of the same shape."""
        gen = torch.Generator().manual_seed(35)
        xq, x_scale = act_quant_fp8_ref(torch.randn(40, 256, generator=gen))
        weight, w_scale = _codes(80, 256, gen), torch.rand(80, generator=gen) * 2e-3 + 1e-4
        out = fp8_gemm_triton(xq, x_scale, weight, w_scale, torch.float32, config=config)
        plain = Fp8GemmConfig(config.block_m, config.block_n, config.block_k, config.split_k)
        assert torch.equal(out, fp8_gemm_triton(xq, x_scale, weight, w_scale, torch.float32, config=plain))
        ref = (xq.double() * x_scale.double()) @ (weight.double() * w_scale.double()[:, None]).T
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())

    def test_fp8_gemm_refuses_other_operands(self) -> None:
        gen = torch.Generator().manual_seed(34)
        xq, x_scale = act_quant_fp8_ref(torch.randn(4, 32, generator=gen))
        weight = _codes(16, 32, gen)
        with pytest.raises(ValueError, match="e4m3"):
            fp8_gemm_triton(xq, x_scale, weight.view(torch.int8), torch.ones(16), torch.float32)
        with pytest.raises(ValueError, match="scales"):
            fp8_gemm_triton(xq, x_scale, weight, torch.ones(16, dtype=torch.float64), torch.float32)


def test_fp8_gemm_splits_narrow_outputs_over_the_inputs() -> None:
    """Too few tiles for the SMs: the inputs split until there are enough, each part 1024 or more."""
    assert fp8_gemm_heuristic(64, 4096, 14336).split_k == 2
    assert fp8_gemm_heuristic(64, 28672, 4096).split_k == 1
    assert fp8_gemm_heuristic(16, 4096, 2048).split_k == 2
    assert fp8_gemm_heuristic(16, 4096, 1024).split_k == 1


if INTERPRETER:
    TestFp8DecodeInterpreted = InterpretedCases
else:

    def test_fp8_decode_kernels_match_references_in_the_interpreter() -> None:
        run_in_interpreter(__file__, min_passed=13)
