"""The direct fp8 decode kernel (:mod:`kernels.attention_decode_direct`) compiled on a GPU: the
reference's output over the same bytes for every q-heads-a-kv-head count it takes, contexts
ending anywhere in a tile, splits with no keys, a request table read through its rows, q far from
1, and the merge that writes the output's FP8 codes; it is the default where it fits.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_decode_direct_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention_decode_direct
from kernels.attention import decode_attention_codes_triton, decode_attention_ref, decode_attention_triton
from kernels.attention_decode_direct import direct_decode_fits
from kernels.kv_quant import quantize_rows
from kernels.quant_matmul import act_quant_fp8_ref
from tests.kernels.test_kernels import make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device that converts fp8 (compute capability 8.9)"),
]

KIND = "fp8_e4m3"


def _batch(ctx_lens: list[int], heads: tuple[int, int], dtype: torch.dtype = torch.bfloat16, seed: int = 3):
    batch = make_paged_batch(ctx_lens, [1] * len(ctx_lens), *heads, 128, layout="shuffled", dtype=dtype,
                             num_slots=sum(ctx_lens) + 64, seed=seed)
    k_cache = quantize_rows(batch.k_cache.float().nan_to_num(0.0), KIND).cuda()
    v_cache = quantize_rows(batch.v_cache.float().nan_to_num(0.0), KIND).cuda()
    return batch, k_cache, v_cache


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Both read the same bytes: agreement to bfloat16's (and float16 probabilities') rounding."""
    assert not torch.isnan(out).any()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err <= 2e-2, f"relative error {err:.2e}"


# Every context length class: shorter than a tile, exact tiles, a tile and one key, and long ones.
CTX_LENS = [1, 5, 31, 32, 33, 64, 100, 257, 1024, 1500, 2049, 4000]


@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (48, 8), (64, 8)], ids=["group1", "group4", "group6", "group8"])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 32])
def test_direct_kernel_reads_fp8_kv_as_the_reference(heads: tuple[int, int], num_splits: int | None) -> None:
    batch, k_cache, v_cache = _batch(CTX_LENS, heads)
    args = (batch.q.cuda(), k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 128**-0.5)
    out = decode_attention_triton(*args, quant=KIND, direct=True, num_splits=num_splits)
    ref = decode_attention_ref(*args, quant=KIND)
    _assert_close(out, ref.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q_far_from_one_and_either_half_dtype(dtype: torch.dtype) -> None:
    # Each q head scaled by its own power of ten: a row's float16 unit that went wrong shows.
    gen = torch.Generator().manual_seed(7)
    ctx_lens = torch.randint(1, 1500, (16,), generator=gen).tolist()
    batch, k_cache, v_cache = _batch(ctx_lens, (32, 8), dtype)
    scale = torch.logspace(-3, 3, 32).view(1, 32, 1)
    q = (batch.q.float() * scale).clamp(-6e4, 6e4).to(dtype).cuda()
    args = (q, k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 128**-0.5)
    out = decode_attention_triton(*args, quant=KIND, direct=True)
    _assert_close(out, decode_attention_ref(*args, quant=KIND).to(dtype))


def test_values_of_tiny_and_huge_scales() -> None:
    # Rows whose scales span 1e-6 to 1e3: the value scales enter the scores as logs, the weights
    # stay within float16 whatever the scale.
    gen = torch.Generator().manual_seed(5)
    batch = make_paged_batch([700, 90], [1, 1], 32, 8, 128, num_slots=900, seed=5)
    span = torch.logspace(-6, 3, 900).view(900, 1, 1)[torch.randperm(900, generator=gen)]
    k_cache = quantize_rows((batch.k_cache.nan_to_num(0.0) * span), KIND).cuda()
    v_cache = quantize_rows((batch.v_cache.nan_to_num(0.0) * span), KIND).cuda()
    args = (batch.q.bfloat16().cuda(), k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 0.05)
    out = decode_attention_triton(*args, quant=KIND, direct=True)
    _assert_close(out, decode_attention_ref(*args, quant=KIND).to(torch.bfloat16))


def test_request_table_read_through_its_rows_and_the_triton_kernel_agrees() -> None:
    batch, k_cache, v_cache = _batch([300, 45, 1200], (32, 8))
    table = batch.slot_table.cuda()
    rows = torch.tensor([2, 0, 1], device="cuda")
    # The table's rows in another order, each sequence pointed at its own.
    shuffled = torch.empty_like(table)
    shuffled[rows] = table
    args = (batch.q.cuda(), k_cache, v_cache)
    out = decode_attention_triton(*args, shuffled, batch.ctx_lens.cuda(), 128**-0.5, quant=KIND, table_rows=rows,
                                  direct=True)
    want = decode_attention_triton(*args, table, batch.ctx_lens.cuda(), 128**-0.5, quant=KIND, direct=False)
    _assert_close(out, want)


def test_merge_writes_the_codes_of_the_output() -> None:
    batch, k_cache, v_cache = _batch(CTX_LENS, (32, 8))
    args = (batch.q.cuda(), k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 128**-0.5)
    codes, scale = decode_attention_codes_triton(*args, quant=KIND, num_splits=4)
    out = decode_attention_triton(*args, quant=KIND, num_splits=4)
    want_codes, want_scale = act_quant_fp8_ref(out.reshape(out.shape[0], -1))
    assert torch.allclose(scale, want_scale, rtol=1e-6)
    apart = (codes.view(torch.int8).int() - want_codes.view(torch.int8).int()).abs()
    assert int(apart.max()) <= 1


def test_direct_is_the_default_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    batch, k_cache, v_cache = _batch([40, 70], (32, 8))
    q = batch.q.cuda()
    assert direct_decode_fits(KIND, q, k_cache, v_cache)
    assert not direct_decode_fits("int8", q, k_cache, v_cache)
    assert not direct_decode_fits(KIND, q.float(), k_cache, v_cache)
    calls = []
    real = attention_decode_direct.decode_split_direct
    monkeypatch.setattr("kernels.attention_decode.decode_split_direct",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    decode_attention_triton(q, k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 0.1, quant=KIND)
    assert calls == [1]
    decode_attention_triton(q, k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 0.1, quant=KIND,
                            block_n=64)  # a Triton tiling asked for: the Triton kernel
    assert calls == [1]
