"""The 8-bit projection kernels compiled on a GPU: the Triton activation quantization writes the
torch one's codes and scales exactly, the weight-only GEMM matches the scaled product at decode
batches (and ``linear`` takes it there), the FP8 GEMM matches ``_scaled_mm`` at 17-64 rows (and
``linear`` takes it there; loading by descriptor changes no bit), and the
one-row 8-bit projections match the reference on Llama-3-8B's shapes (products in float16
pairs: over every code and inputs of any magnitude).

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_quant_matmul_gpu.py -s
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.fp8_gemm import FP8_GEMM_MAX_ROWS, Fp8GemmConfig, fp8_gemm_triton
from kernels.gemv import linear_ref, linear_triton, norm_linear_ref, norm_linear_triton, silu_linear_ref
from kernels.gemv import silu_linear_triton
from kernels.quant_matmul import FP8_WEIGHT_ONLY_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS, act_quant_fp8_ref, act_quant_fp8_triton
from kernels.quant_matmul import weight_only_linear_triton
from pd_cluster.model.quant_linear import fp8_codes_product, fp8_gemm, fp8_gemm_supported, fp8_scaled_mm, linear
from pd_cluster.model.quant_linear import quantize
from pd_cluster.model.quant_linear import weight_only_supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
METHODS = ["int8", "fp8"] if FP8 else ["int8"]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.skipif(not FP8, reason="float8 conversions need compute capability 8.9")
@pytest.mark.parametrize("rows, k", [(1, 4096), (64, 4096), (4096, 4096), (37, 14336), (3, 100)])
def test_activation_quantization_writes_the_torch_codes_and_scales(rows, k):
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 3
    x[0] = 0  # a zero row: the floor's scale, zero codes
    q, scale = act_quant_fp8_triton(x)
    ref_q, ref_scale = act_quant_fp8_ref(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [9, 16, 64, 128, 129])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336)])
def test_weight_only_gemm_matches_the_scaled_product(method, rows, n, k):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, method)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref = linear_ref(x.float(), q.qweight, q.scale) + bias.float()
    out = weight_only_linear_triton(x, q.qweight, q.scale, bias)
    # One bfloat16 rounding of the output (2**-9 relative) over float32 sums in another order.
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 4e-3
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    limit = FP8_WEIGHT_ONLY_MAX_ROWS if method == "fp8" else WEIGHT_ONLY_MAX_ROWS
    assert weight_only_supported(x, q) == (hopper and rows <= limit)
    if hopper and rows <= limit:
        assert torch.equal(linear(x, q, bias), out)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_one_row_gemv_reads_8_bit_weights_in_its_tiles(method, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, method)
    out, ref = linear_triton(x, q.qweight, q.scale), linear_ref(x.float(), q.qweight, q.scale)
    assert _rel(out, ref) < 4e-3


#: One row's ways of loading 8-bit codes, beside the tables' choice (None, for each method): the
#: tile, then the options (8 codes a thread in the input's layout; blocks streamed or carried;
#: products in float32 or in float16 pairs).
LOAD_SHAPES = [None, ((1, 4, 1024), {"vec": 8, "stream": False, "f16": True}),
               ((1, 8, 512), {"vec": 16, "stream": True, "f16": True}), ((1, 4, 1024), {"vec": 8, "stream": True}),
               ((1, 2, 2048), {"vec": 8, "stream": False}), ((1, 4, 4096), {"vec": 8, "f16": True}),
               ((1, 4, 4096), {"vec": 8, "f16": False})]
LOAD_CASES = [(method, 0) for method in METHODS] + [("fp8" if FP8 else "int8", i) for i in range(1, len(LOAD_SHAPES))]


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("method, load", LOAD_CASES)
def test_one_row_8_bit_projections_match_in_each_load_shape(method, load, n, k):
    """The plain, norm and SiLU projections of one row, compiled with each way of loading the
    codes (the interpreter runs the loads' hints as plain loads): the reference's."""
    shape = LOAD_SHAPES[load]
    config = {"tiles": shape[0], **shape[1]} if shape else {}
    gen = torch.Generator(device="cuda").manual_seed(n + k + load)
    x, residual = (torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    norm_w = torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    q = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, method)
    assert _rel(linear_triton(x, q.qweight, q.scale, **config), linear_ref(x.float(), q.qweight, q.scale)) < 4e-3
    # The fused ops against the unfused ones in bfloat16 (the same roundings of the norm and the
    # gate; the product's sums in another order, then one rounding of the output each).
    out, new_residual = norm_linear_triton(x, residual, norm_w, 1e-5, q.qweight, weight_scale=q.scale, **config)
    ref, ref_residual = norm_linear_ref(x, residual, norm_w, 1e-5, q.qweight, weight_scale=q.scale)
    assert _rel(out, ref) < 1e-2 and torch.equal(new_residual, ref_residual)
    gate_up = torch.randn(1, 2 * k, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = silu_linear_triton(gate_up, q.qweight, q.scale, **config)
    assert _rel(out, silu_linear_ref(gate_up, q.qweight, q.scale)) < 1e-2


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e6])
def test_float16_pair_products_cover_every_code_in_every_byte(method, magnitude):
    """Every code (e4m3's subnormals and largest, int8's -128 to 127) in each byte of a code word,
    times inputs spread over four decades around ``magnitude``: products in float16 pairs (each
    run of eight inputs scaled by its largest; blocks carried or streamed, one block with the
    norm) are as close to a float64 reference as one bfloat16 rounding of the output."""
    n, k = 64, 1024
    codes = ((torch.arange(k, device="cuda")[None, :] * 7 + torch.arange(n, device="cuda")[:, None] * 13) % 256)
    codes = codes.to(torch.uint8)
    if method == "fp8":
        codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN
        weight = codes.view(torch.float8_e4m3fn)
    else:
        weight = codes.view(torch.int8)
    scale = torch.rand(n, device="cuda") * 1e-3 + 1e-4
    gen = torch.Generator(device="cuda").manual_seed(48)
    x = (torch.randn(1, k, device="cuda", generator=gen) * magnitude
         * 10 ** (4 * torch.rand(1, k, device="cuda", generator=gen) - 2)).to(torch.bfloat16)
    ref = (x.double() @ weight.double().t()) * scale.double()
    for config in ({"tiles": (1, 4, 256), "stream": False, "f16": True}, {"tiles": (1, 8, 256), "stream": True, "f16": True},
                   {"tiles": (1, 4, 1024), "f16": True}, {"tiles": (1, 4, 1024), "f16": False}):
        out = linear_triton(x, weight, scale, vec=8, **config)
        assert _rel(out, ref) < 4e-3, config
    residual, norm_w = torch.zeros_like(x), torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    ref, _ = norm_linear_ref(x, residual, norm_w, 1e-5, weight, weight_scale=scale)
    for f16 in (False, True):
        out, _ = norm_linear_triton(x, residual, norm_w, 1e-5, weight, weight_scale=scale, tiles=(1, 4, 1024),
                                    vec=8, f16=f16)
        assert _rel(out, ref) < 1e-2, f16


@pytest.mark.skipif(not FP8 or torch.cuda.get_device_capability() < (9, 0), reason="FP8 products need sm_90")
@pytest.mark.parametrize("rows", [17, 32, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_fp8_gemm_matches_the_scaled_product_and_serves_decode_batches(rows, n, k):
    """The same codes and scales as ``_scaled_mm``: float32 sums in another order (promoted every
    block, as cuBLAS without fast accumulation), one bfloat16 rounding; ``linear`` takes it from
    past the weight-only GEMM's rows to ``FP8_GEMM_MAX_ROWS``, split-K configs included."""
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, "fp8")
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref = fp8_scaled_mm(x, q, bias)
    out = fp8_gemm(x, q, bias)
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 4e-3
    assert fp8_gemm_supported(x, q) and torch.equal(linear(x, q, bias), out)
    xq, x_scale = act_quant_fp8_triton(x)
    assert torch.equal(fp8_codes_product(xq, x_scale, q, torch.bfloat16, bias), out)  # codes made before
    for split in (1, 3):
        cfg = Fp8GemmConfig(64, 64, 256, split, 4, 3)
        plain = fp8_gemm_triton(xq, x_scale, q.qweight, q.scale, torch.bfloat16, bias, cfg)
        assert _rel(plain, ref) < 4e-3
        # Descriptor loads: the same bits.
        assert torch.equal(fp8_gemm_triton(xq, x_scale, q.qweight, q.scale, torch.bfloat16, bias,
                                           replace(cfg, tma=True)), plain)
    assert not fp8_gemm_supported(torch.randn(FP8_GEMM_MAX_ROWS + 1, k, device="cuda", dtype=torch.bfloat16), q)
