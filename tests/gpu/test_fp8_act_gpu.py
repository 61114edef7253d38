"""The FP8 prefill's fused activation quantization compiled on a GPU: RMSNorm and the SiLU gate
write the codes and scales the unfused kernels' output quantizes to, bit for bit, so the model's
products and greedy tokens are those of the unfused path; the context attention takes its tiles
in either order with the same result.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fp8_act_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention_decode
from kernels.attention import (context_attention_triton, decode_attention_codes_triton, decode_attention_ref,
                               decode_attention_triton)
from kernels.kv_quant import quantize_rows
from kernels.fp8_act import rms_norm_quant_fp8_ref, rms_norm_quant_fp8_triton, silu_mul_quant_fp8_triton
from kernels.fp8_gated import fp8_gate_up_silu_triton
from kernels.fp8_gemm import fp8_gemm_triton
from kernels.quant_matmul import act_quant_fp8_triton
from kernels.rms_norm import rms_norm, rms_norm_triton
from kernels.silu_mul import silu_mul, silu_mul_triton
from pd_cluster import LLM, SamplingParams
from pd_cluster.model import fp8_fused, llama
from pd_cluster.model.quant_linear import FP8_WEIGHT_ONLY_MAX_ROWS, linear, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
SCALED_MM = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _bits(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


@pytest.mark.skipif(not FP8, reason="float8 conversions need compute capability 8.9")
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows, hidden", [(4096, 4096), (37, 2048), (5, 100)])
def test_rms_norm_writes_the_unfused_codes(rows, hidden, with_residual):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    residual = torch.randn(rows, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) if with_residual else None
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    x[0] = 0
    if residual is not None:
        residual[0] = 0  # a zero row: the floor's scale, zero codes
    codes, scale, new_residual = rms_norm_quant_fp8_triton(x, weight, 1e-5, residual)
    normed, want_residual = rms_norm_triton(x, weight, 1e-5, residual)
    want_codes, want_scale = act_quant_fp8_triton(normed)
    assert torch.equal(_bits(codes), _bits(want_codes)) and torch.equal(scale, want_scale)
    assert torch.equal(new_residual, want_residual)
    # The torch reference sums the row's squares in another order: a code in a thousand may differ.
    ref_codes, _, _ = rms_norm_quant_fp8_ref(x, weight, 1e-5, residual)
    apart = (codes.view(torch.int8).int() - ref_codes.view(torch.int8).int()).abs()
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-3


@pytest.mark.skipif(not FP8, reason="float8 conversions need compute capability 8.9")
@pytest.mark.parametrize("rows, inter", [(4096, 14336), (64, 8192), (300, 1000), (3, 9000)])
def test_silu_gate_writes_the_unfused_codes(rows, inter):
    gen = torch.Generator(device="cuda").manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    gate_up[0] = 0
    codes, scale = silu_mul_quant_fp8_triton(gate_up)
    want_codes, want_scale = act_quant_fp8_triton(silu_mul_triton(gate_up))
    assert torch.equal(_bits(codes), _bits(want_codes)) and torch.equal(scale, want_scale)


@pytest.mark.skipif(not SCALED_MM, reason="row-wise FP8 products need compute capability 9.0")
def test_fused_projections_are_the_unfused_products():
    gen = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(300, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(300, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    norm_w = (torch.rand(4096, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    gate_up_w = quantize(torch.randn(2 * 1024, 4096, device="cuda", generator=gen) * 0.02, "fp8")
    down_w = quantize(torch.randn(4096, 1024, device="cuda", generator=gen) * 0.02, "fp8")
    assert fp8_fused.fused_fp8(hidden, gate_up_w)
    gate_up, new_residual = fp8_fused.norm_then_linear(hidden, residual, norm_w, 1e-5, gate_up_w)
    x, want_residual = rms_norm(hidden, norm_w, 1e-5, residual)
    assert torch.equal(gate_up, linear(x, gate_up_w)) and torch.equal(new_residual, want_residual)
    assert torch.equal(fp8_fused.silu_then_linear(gate_up, down_w), linear(silu_mul(gate_up), down_w))
    assert not fp8_fused.fused_fp8(hidden[:FP8_WEIGHT_ONLY_MAX_ROWS], gate_up_w)  # few rows: the weight-only kernels


@pytest.mark.skipif(not SCALED_MM, reason="row-wise FP8 products need compute capability 9.0")
def test_fp8_model_greedy_tokens_fused_or_not(small_model, monkeypatch):
    """Prompts of more rows than the weight-only kernels take run the fused prefill; its codes are
    the unfused ones, so every greedy token is the same."""
    prompts = [list(range(100 + i, 400 + 7 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(model=str(small_model), device="cuda", dtype="bfloat16", max_total_tokens=8192, quantization="fp8")
        try:
            return [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.close()

    calls: list[int] = []
    fused = fp8_fused.fused_fp8

    def counted(x: torch.Tensor, weight) -> bool:
        taken = fused(x, weight)
        if taken:
            calls.append(x.shape[0])
        return taken

    monkeypatch.setattr(fp8_fused, "fused_fp8", counted)
    got = run()
    assert calls, "the fused path never ran"
    monkeypatch.setattr(fp8_fused, "fused_fp8", lambda x, w: False)
    assert got == run()


@pytest.mark.skipif(not FP8, reason="float8 conversions need compute capability 8.9")
@pytest.mark.parametrize("kind", [None, "fp8_e4m3"])
@pytest.mark.parametrize("batch", [24, 64])
def test_decode_attention_merge_writes_the_unfused_codes(kind, batch):
    """The decode merge writing the o projection's codes (a program a sequence, 8B heads) gives
    act_quant_fp8 of the merged output, bit for bit, at the split counts the launcher picks."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    ctx = torch.randint(1, 1500, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    width = int(ctx.max())
    slots = batch * width
    table = torch.randperm(slots, device="cuda", generator=gen).view(batch, width)
    k = torch.randn(slots, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(slots, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    if kind is not None:
        k, v = quantize_rows(k.float(), kind), quantize_rows(v.float(), kind)
    q = torch.randn(batch, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    args = (q, k, v, table, ctx, 128**-0.5)
    splits = attention_decode._decode_num_splits(batch, 8, width, attention_decode._decode_config(
        q.dtype, batch * 8, 128)[0], q.device, per_sm=4 if kind is None else 2)
    codes, scale = decode_attention_codes_triton(*args, quant=kind)
    out = decode_attention_triton(*args, quant=kind)
    want_codes, want_scale = act_quant_fp8_triton(out.reshape(batch, -1))
    assert torch.equal(scale, want_scale), f"{splits} splits"
    assert torch.equal(_bits(codes), _bits(want_codes)), f"{splits} splits"
    ref = decode_attention_ref(q.float(), k if kind else k.float(), v if kind else v.float(), table, ctx, 128**-0.5,
                               quant=kind)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2


@pytest.mark.skipif(not SCALED_MM, reason="FP8 scaled products need compute capability 9.0")
def test_fp8_decode_greedy_tokens_with_the_merge_writing_codes_or_not(small_model, monkeypatch):
    """24 sequences decode through the FP8 GEMM (more rows than the weight-only kernels take): the
    o projection's codes come from the attention's merge, or from quantizing its output after;
    the codes are the same, so is every greedy token."""
    prompts = [list(range(100 + i, 300 + 5 * i)) for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(model=str(small_model), device="cuda", dtype="bfloat16", max_total_tokens=16384,
                  quantization="fp8", cuda_graphs=False)
        try:
            return [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.close()

    merged: list[int] = []
    fits = attention_decode._merge_codes_fits

    def counted(*shape: int) -> bool:
        taken = fits(*shape)
        merged.append(taken)
        return taken

    monkeypatch.setattr(attention_decode, "_merge_codes_fits", counted)
    got = run()
    assert any(merged), "the merge never wrote codes"
    monkeypatch.setattr(attention_decode, "MERGE_CODES_MAX_VALUES", 0)
    assert got == run()


@pytest.mark.skipif(not SCALED_MM, reason="FP8 scaled products need compute capability 9.0")
@pytest.mark.parametrize("rows, inter, k", [(64, 14336, 4096), (37, 14336, 4096), (16, 1000, 2048)])
def test_gate_up_gated_in_its_epilogue_writes_the_unfused_codes(rows, inter, k):
    """The gate/up GEMM gating its own output (by descriptor, two products a block): the codes and
    scales of the plain FP8 GEMM's output gated and quantized after it, bit for bit; 1000 gated
    outputs end in a partial tile."""
    gen = torch.Generator(device="cuda").manual_seed(inter + rows)
    w = quantize(torch.randn(2 * inter, k, device="cuda", generator=gen) * 0.02, "fp8")
    xq, x_scale = act_quant_fp8_triton(torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16))
    codes, scale = fp8_gate_up_silu_triton(xq, x_scale, w.qweight, w.scale, torch.bfloat16)
    gate_up = fp8_gemm_triton(xq, x_scale, w.qweight, w.scale, torch.bfloat16)
    want_codes, want_scale = silu_mul_quant_fp8_triton(gate_up)
    assert torch.equal(scale, want_scale)
    assert torch.equal(_bits(codes), _bits(want_codes))


@pytest.mark.skipif(not SCALED_MM, reason="FP8 scaled products need compute capability 9.0")
def test_fp8_decode_greedy_tokens_with_the_gate_up_gating_its_output_or_not(small_model, monkeypatch):
    """40 sequences decode through the FP8 GEMM, in CUDA graphs: the MLP's gate/up GEMM gates its
    own output, or the SiLU kernels gate it after; the codes are the same, so is every greedy token."""
    prompts = [list(range(100 + i, 300 + 5 * i)) for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(model=str(small_model), device="cuda", dtype="bfloat16", max_total_tokens=16384,
                  quantization="fp8")
        try:
            return [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.close()

    served: list[bool] = []
    fused = llama.norm_gate_up_silu_down_fp8

    def counted(*args):
        done = fused(*args)
        served.append(done is not None)
        return done

    monkeypatch.setattr(llama, "norm_gate_up_silu_down_fp8", counted)
    got = run()
    assert any(served), "the gated gate/up GEMM never ran"
    monkeypatch.setattr(llama, "norm_gate_up_silu_down_fp8", lambda *args: None)
    assert got == run()


def test_context_attention_tile_order_changes_nothing():
    gen = torch.Generator(device="cuda").manual_seed(7)
    n, kv_heads, heads, dim = 1000, 8, 32, 128
    q = torch.randn(n + 300, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(n + 300 + 64, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # A fresh prompt, then a chunk of 300 after a 700-token prefix.
    table = torch.stack([torch.arange(n, device="cuda"), torch.arange(64, 64 + n, device="cuda")])
    ctx = torch.tensor([n, n], device="cuda")
    q_lens = torch.tensor([n, 300], device="cuda")
    starts = torch.tensor([0, n], device="cuda")
    outs = [context_attention_triton(q, k, v, table, ctx, q_lens, starts, dim**-0.5, heavy_first=h) for h in (True, False)]
    assert torch.equal(outs[0], outs[1])


def test_fresh_prompts_attend_through_sdpa_as_through_triton():
    """Two fresh prompts of a ragged step (after one decode row) through cuDNN against the Triton
    kernel over the same stored keys: bfloat16 roundings apart."""
    from kernels.attention import context_attention_triton as triton_attention
    from pd_cluster.model.prefill_sdpa import fresh_attention, fresh_spans, sdpa_applies

    gen = torch.Generator(device="cuda").manual_seed(9)
    lens = [1, 700, 1500]  # a decode row's token, then two prompts
    total, kv_heads, heads, dim = sum(lens), 8, 32, 128
    q = torch.randn(total, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(total + 500, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out_slots = torch.randperm(total + 500, device="cuda", generator=gen)[:total]
    spans = fresh_spans([(0, 1, 40), (1, 700, 700), (701, 1500, 1500)], num_decode=1)
    assert spans == [(1, 700), (701, 1500)] and sdpa_applies(q, k, None)
    out = torch.zeros_like(q)
    fresh_attention(q, k, v, out_slots, spans, dim**-0.5, out)
    table = torch.zeros(2, 1500, dtype=torch.int64, device="cuda")
    table[0, :700], table[1] = out_slots[1:701], out_slots[701:]
    ref = triton_attention(q[1:], k, v, table, torch.tensor([700, 1500], device="cuda"),
                           torch.tensor([700, 1500], device="cuda"), torch.tensor([0, 700], device="cuda"), dim**-0.5)
    assert float((out[1:].float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # the decode row is left to the decode kernel


def test_greedy_tokens_with_sdpa_prefill_agree(small_model, monkeypatch):
    """Long fresh prompts through cuDNN against the Triton kernel: the same greedy tokens but where
    bfloat16 roundings flip a near tie (random weights have many)."""
    from pd_cluster.model import prefill_sdpa

    prompts = [list(range(1000 + 3 * i, 1600 + 5 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run() -> list[list[int]]:
        # Whole prompts in one eager step: a node's default chunks are its mixed graphs' sizes,
        # replayed through the Triton kernel they were captured with.
        llm = LLM(model=str(small_model), device="cuda", dtype="bfloat16", max_total_tokens=8192,
                  prefill_chunk_tokens=2048, mixed_graph_tokens=[])
        try:
            return [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.close()

    calls: list[int] = []
    attend = prefill_sdpa.fresh_attention
    monkeypatch.setattr(prefill_sdpa, "fresh_attention", lambda *a: calls.append(1) or attend(*a))
    import pd_cluster.model.llama as llama

    monkeypatch.setattr(llama, "fresh_attention", prefill_sdpa.fresh_attention)
    with_sdpa = run()
    assert calls, "the cuDNN path never ran"
    monkeypatch.setattr(llama, "fresh_spans", lambda *a: None)
    without = run()
    same = sum(a == b for x, y in zip(with_sdpa, without) for a, b in zip(x, y))
    assert with_sdpa[0][0] == without[0][0] and same >= 0.9 * sum(len(x) for x in without)
