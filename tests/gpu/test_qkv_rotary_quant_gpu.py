"""The qkv projection that finishes its own output, compiled on a GPU: the FP8 GEMM's rotary
epilogue (9 to 64 rows) against the projection then the rotary kernel on the same inputs, on
Llama-3-8B's shape and the default model's; then a model's greedy tokens with the epilogue and
without.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_qkv_rotary_quant_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.kv_quant import row_bytes
from kernels.qkv_epilogue import QkvRotary
from pd_cluster import LLM, SamplingParams
from pd_cluster.model import fp8_fused, llama
from pd_cluster.model.quant_linear import quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCALED_MM = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
#: (q heads, kv heads, head_dim, hidden): Llama-3-8B's and the default model's.
SHAPES = [(32, 8, 128, 4096), (9, 3, 64, 576)]
SLOTS = 4096


def _inputs(rows: int, hidden: int, head_dim: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    cos, sin = kernels.rotary_cos_sin(head_dim, 8192, 500000.0, None, "cuda")
    positions = torch.randint(0, 8192, (rows,), device="cuda", generator=gen)
    slots = torch.randperm(SLOTS, device="cuda", generator=gen)[:rows]
    return x, residual, norm, cos, sin, positions, slots


def _caches(kv_heads: int, head_dim: int, quant: str | None) -> list[torch.Tensor]:
    if quant is None:
        return [torch.full((SLOTS, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
                for _ in range(2)]
    return [torch.zeros((SLOTS, kv_heads, row_bytes(head_dim)), dtype=torch.uint8, device="cuda") for _ in range(2)]


def _unfused(qkv: torch.Tensor, hq: int, hkv: int, head_dim: int, positions, cos, sin, caches, slots, quant):
    rows = qkv.shape[0]
    q, k, v = qkv.split((hq * head_dim, hkv * head_dim, hkv * head_dim), dim=-1)
    return kernels.rotary_store_kv(q.reshape(rows, hq, head_dim), k.reshape(rows, hkv, head_dim),
                                   v.reshape(rows, hkv, head_dim), positions, cos, sin, *caches, slots, quant)


def _assert_same(q, want_q, caches, want_caches, slots) -> None:
    assert torch.equal(q.reshape(want_q.shape), want_q)
    for got, want in zip(caches, want_caches):
        assert torch.equal(got[slots], want[slots])


def _assert_near(q, want_q, caches, want_caches, slots) -> None:
    """The same bits but for the odd element one rounding apart: each kernel's compiler contracts
    the rotation's products (and the scale's and the bias') into FMAs as it sees fit, and a
    bfloat16 rounding near a tie then lands an ulp away (an H200: 1 to 3 elements of 64 rows'
    q and KV). A quantized cache's row takes its scale from its largest value: such an element may
    move the row's codes, so there the rows that differ are counted."""
    for got, want in [(q.reshape(want_q.shape), want_q)] + [(c[slots], w[slots]) for c, w in zip(caches, want_caches)]:
        if got.dtype == torch.uint8:
            rows = got.reshape(-1, got.shape[-1])
            assert int((rows != want.reshape(rows.shape)).any(-1).sum()) <= max(2, rows.shape[0] // 100)
            continue
        apart = got != want
        assert int(apart.sum()) <= max(4, got.numel() // 1000)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)


@pytest.mark.skipif(not SCALED_MM, reason="the FP8 GEMM's paths need compute capability 9.0")
@pytest.mark.parametrize("quant", [None, "fp8_e4m3", "int8"])
@pytest.mark.parametrize("rows", [9, 16, 32, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_gemm_epilogue_is_the_unfused_ops(quant, rows, shape):
    """The 8B shape's configs: 16 and 32 rows split (the parts' sum rotates), 64 whole tiles."""
    hq, hkv, head_dim, hidden = shape
    x, residual, norm, cos, sin, positions, slots = _inputs(rows, hidden, head_dim, rows + 100)
    weight = quantize(torch.randn((hq + 2 * hkv) * head_dim, hidden, device="cuda") * hidden**-0.5, "fp8")
    bias = torch.randn(weight.qweight.shape[0], device="cuda").to(torch.bfloat16) if hidden < 4096 else None
    caches, want_caches = _caches(hkv, head_dim, quant), _caches(hkv, head_dim, quant)
    rotary = QkvRotary(positions, cos, sin, hq, hkv, head_dim, *caches, slots)
    done = fp8_fused.norm_qkv_rotary_fp8(x, residual, norm, 1e-5, weight, bias, rotary, quant)
    assert done is not None, "the FP8 GEMM's epilogue did not serve"
    qkv, want_residual = fp8_fused.norm_then_linear(x, residual, norm, 1e-5, weight, bias)
    want_q = _unfused(qkv, hq, hkv, head_dim, positions, cos, sin, want_caches, slots, quant)
    assert torch.equal(done[1], want_residual)
    _assert_near(done[0], want_q, caches, want_caches, slots)


@pytest.mark.skipif(not SCALED_MM, reason="the FP8 GEMM's paths need compute capability 9.0")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_fp8_model_greedy_tokens_with_the_epilogue_or_without(small_model, monkeypatch, kv_cache_dtype):
    """Twenty sequences decode together (steps of 9 to 20 rows take the FP8 GEMM): the same greedy
    tokens with the qkv GEMM's rotary epilogue as with the rotary kernel after it."""
    prompts = [list(range(100 + i, 140 + 3 * i)) for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    extra = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}

    def run() -> list[list[int]]:
        llm = LLM(model=str(small_model), device="cuda", dtype="bfloat16", max_total_tokens=8192, quantization="fp8",
                  **extra)
        try:
            return [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.close()

    calls: list[int] = []
    epilogue = fp8_fused.norm_qkv_rotary_fp8

    def counted(*args, **kwargs):
        done = epilogue(*args, **kwargs)
        if done is not None:
            calls.append(args[0].shape[0])
        return done

    monkeypatch.setattr(llama, "norm_qkv_rotary_fp8", counted)
    got = run()
    assert calls, "the epilogue never ran"
    monkeypatch.setattr(llama, "norm_qkv_rotary_fp8", lambda *a, **k: None)
    assert got == run()
