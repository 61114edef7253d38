"""The fp8-weight decode kernels against float references, run by Triton's interpreter: the one-row
projection over float8 codes read as words (:mod:`kernels.gemv_fp8`; its code conversion exact on
every e4m3 value; the qkv projection with rotary and the KV store on it) and the FP8 GEMM of
decode batches (:mod:`kernels.fp8_gemm`, split-K included).

As in ``test_kernels_triton.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported:
with it set the interpreted cases are collected, else one test runs this file in a child pytest.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_heuristic, fp8_gemm_triton
from kernels.gemv import (
    linear_ref,
    linear_triton,
    norm_linear_ref,
    norm_linear_triton,
    silu_linear_ref,
    silu_linear_triton,
)
from kernels.gemv_fp8 import fits_words, words_by_default
from kernels.qkv_rotary import norm_qkv_rotary_ref, norm_qkv_rotary_triton
from kernels.quant_matmul import act_quant_fp8_ref
from kernels.rotary import rotary_cos_sin
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter
from tests.kernels.test_kernels_triton import (
    GEMV_TOL,
    QKV_ROTARY_TOL,
    QUANT_GEMV_TOL,
    assert_close_elementwise,
    assert_matches,
)

FP8 = torch.float8_e4m3fn


def _codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 448 / 3).clamp(-448, 448).to(FP8)


def _every_code() -> torch.Tensor:
    """The 254 e4m3 values that are not NaN, zeros and subnormals included."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    return codes[~torch.isnan(codes.float())]


class InterpretedCases:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("words", [True, ((4, 32), 4), ((16, 64), 8)])
    def test_one_row_over_words_matches_the_unfused_ops(self, dtype: torch.dtype, words) -> None:
        """The default tiles and two others, over 1040 inputs (blocks of 128 to 1024 inputs, the last
        partial), with the norm (and its residual sum), the SiLU gate and neither; bias, and a
        picked row."""
        gen = torch.Generator().manual_seed(31)
        n, k = 37, 1040
        # Outputs of a few units (the interpreter truncates bfloat16 inputs: an ulp or two there).
        weight, scale = _codes(n, k, gen), torch.rand(n, generator=gen) * 2e-4 + 1e-5
        assert fits_words(weight, 1, k)
        x, residual = torch.randn(3, k, generator=gen).to(dtype), torch.randn(3, k, generator=gen).to(dtype)
        norm_weight, bias = (torch.rand(k, generator=gen) + 0.5).to(dtype), torch.randn(n, generator=gen).to(dtype)
        row = torch.tensor([2])
        tol = QUANT_GEMV_TOL[dtype]
        assert_matches(linear_triton(x[:1], weight, scale, words=words), linear_ref(x[:1], weight, scale), *tol)
        out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, bias, rows=row,
                                               weight_scale=scale, words=words)
        ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, bias, rows=row, weight_scale=scale)
        assert_matches(out, ref, *tol)
        assert_close_elementwise(new_residual, ref_residual)
        gate_up = torch.randn(1, 2 * k, generator=gen).to(dtype)
        assert_matches(silu_linear_triton(gate_up, weight, scale, words=words), silu_linear_ref(gate_up, weight, scale),
                       *tol)

    def test_words_take_every_code_exactly(self) -> None:
        """One-hot inputs read single weights: each of the 254 values, at each byte of a word,
        comes out exact (the subnormal codes as float32 subnormals times 2**-120, scaled back)."""
        values = _every_code()
        weight = torch.stack([values.roll(j) for j in range(16)], dim=1).contiguous()  # [254, 16]
        eye = torch.eye(16)
        got = torch.cat([linear_triton(eye[j:j + 1], weight, torch.ones(values.numel()), words=True)
                         for j in range(16)])
        assert torch.equal(got, weight.float().T)

    def test_words_serve_one_row_of_float8_in_whole_words_only(self) -> None:
        gen = torch.Generator().manual_seed(32)
        assert not fits_words(_codes(8, 40, gen), 1, 40)  # rows of 40 bytes: not 16-byte words
        assert not fits_words(_codes(8, 64, gen), 2, 64)
        assert not fits_words(_codes(8, 64, gen).view(torch.int8), 1, 64)
        assert not words_by_default(1, 6144, 4096)  # measured slower than the GEMV: asked for only
        # Where words do not serve, the float8 rows take the GEMV (and match it there too).
        weight, scale, x = _codes(9, 40, gen), torch.rand(9, generator=gen) * 1e-3, torch.randn(1, 40, generator=gen)
        assert_matches(linear_triton(x, weight, scale), linear_ref(x, weight, scale), *GEMV_TOL[torch.float32])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(("head_dim", "with_bias"), [(16, False), (64, True)])
    def test_qkv_rotary_over_words_matches_the_unfused_ops(self, dtype: torch.dtype, head_dim: int,
                                                           with_bias: bool) -> None:
        """One row's qkv projection over float8 words with the rotation and the KV store folded in,
        against the projection then ``rotary_store_kv``: 3 q heads over 1 kv head, 96 inputs."""
        hq, hkv, hidden = 3, 1, 96
        gen = torch.Generator().manual_seed(35)
        x = (torch.randn(1, hidden, generator=gen) * 2).to(dtype)
        residual = torch.randn(1, hidden, generator=gen).to(dtype)
        norm_weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        weight = _codes((hq + 2 * hkv) * head_dim, hidden, gen)
        scale = torch.rand(weight.shape[0], generator=gen) * 2e-4 + 1e-5
        bias = torch.randn(weight.shape[0], generator=gen).to(dtype) if with_bias else None
        cos, sin = rotary_cos_sin(head_dim, 64, 10000.0)
        positions, slots = torch.tensor([37]), torch.tensor([5])
        caches = [torch.full((8, hkv, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
        args = (x, residual, norm_weight, 1e-5, weight, bias, positions, cos, sin)
        q, new_residual = norm_qkv_rotary_triton(*args, caches[0], caches[1], slots, hq, hkv, scale)
        q_ref, ref_residual = norm_qkv_rotary_ref(*args, caches[2], caches[3], slots, hq, hkv, scale)
        assert_matches(q, q_ref, *QKV_ROTARY_TOL[dtype])
        assert_close_elementwise(new_residual, ref_residual)
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.isnan(got[torch.arange(8) != 5]).all()
            assert_matches(got[5], want[5], *QKV_ROTARY_TOL[dtype])
        with pytest.raises(ValueError, match="one row"):
            norm_qkv_rotary_triton(x.repeat(2, 1), None, *args[2:6], positions.repeat(2), cos, sin, caches[0],
                                   caches[1], torch.tensor([1, 2]), hq, hkv, scale)

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
        run_in_interpreter(__file__, min_passed=16)
