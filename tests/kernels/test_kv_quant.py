"""Quantized KV (int8, fp8_e4m3) on the reference path: store, attention and the handover's
conversion against the float path."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.attention import context_attention_ref, decode_attention_ref
from kernels.kv_quant import dequantize_rows, quantize_rows, row_bytes
from kernels.kv_transfer import convert_kv
from kernels.store_kv import store_kv_ref
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.kv_spec import KVSpec

#: Largest error of an attention output against the float path, relative to the output's largest
#: magnitude: int8 keeps 7 bits a value, fp8 e4m3 3 bits of mantissa.
TOLERANCE = {"int8": 0.02, "fp8_e4m3": 0.08}
HEADS, KV_HEADS, HEAD_DIM, SLOTS = 6, 2, 64, 64


def _filled_caches(kind: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Float caches and quantized caches holding the same keys and values at ``slots``."""
    fk = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM)
    fv = torch.zeros_like(fk)
    store_kv_ref(k, v, fk, fv, slots)
    qk = torch.zeros(SLOTS, KV_HEADS, row_bytes(HEAD_DIM), dtype=torch.uint8)
    qv = torch.zeros_like(qk)
    store_kv_ref(k, v, qk, qv, slots, kind)
    return (fk, fv), (qk, qv)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_store_quantizes_each_token_head_with_its_own_scale(kind: str) -> None:
    torch.manual_seed(0)
    k = torch.randn(5, KV_HEADS, HEAD_DIM) * torch.tensor([1.0, 100.0]).view(1, 2, 1)
    v = torch.randn(5, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([3, 9, 0, 40, 7])
    (fk, _), (qk, _) = _filled_caches(kind, k, v, slots)
    back = dequantize_rows(qk[slots], kind, HEAD_DIM, torch.float32)
    bound = TOLERANCE[kind] * k.abs().amax(dim=-1, keepdim=True)
    assert ((back - k).abs() <= bound).all()  # head 1 (100x larger) does not swamp head 0
    assert torch.equal(qk[1], torch.zeros_like(qk[1]))  # other slots untouched


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_attention_on_quantized_kv_matches_the_float_path(kind: str) -> None:
    torch.manual_seed(1)
    ctx = [17, 30]
    slots = torch.randperm(SLOTS)[: sum(ctx)]
    k, v = torch.randn(sum(ctx), KV_HEADS, HEAD_DIM), torch.randn(sum(ctx), KV_HEADS, HEAD_DIM)
    (fk, fv), (qk, qv) = _filled_caches(kind, k, v, slots)
    table = torch.zeros(2, max(ctx), dtype=torch.int64)
    table[0, : ctx[0]], table[1, : ctx[1]] = slots[: ctx[0]], slots[ctx[0] :]
    ctx_lens, q_lens = torch.tensor(ctx), torch.tensor([5, 30])
    q = torch.randn(int(q_lens.sum()), HEADS, HEAD_DIM)
    starts = torch.tensor([0, 5])
    scale = HEAD_DIM**-0.5
    for fn, args in ((context_attention_ref, (ctx_lens, q_lens, starts)), (kernels.context_attention,
                                                                           (ctx_lens, q_lens, starts))):
        want = context_attention_ref(q, fk, fv, table, *args, scale)
        got = fn(q, qk, qv, table, *args, scale, quant=kind)
        err = (got - want).abs().max() / want.abs().max()
        print(f"{kind} {fn.__name__}: max error {err:.4f} of the output's largest value")
        assert err < TOLERANCE[kind]
    qd = torch.randn(2, HEADS, HEAD_DIM)
    for fn in (decode_attention_ref, kernels.decode_attention):
        want = decode_attention_ref(qd, fk, fv, table, ctx_lens, scale)
        got = fn(qd, qk, qv, table, ctx_lens, scale, quant=kind)
        assert (got - want).abs().max() / want.abs().max() < TOLERANCE[kind]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_handover_conversion_writes_what_ds_own_store_would(kind: str) -> None:
    torch.manual_seed(2)
    spec = KVSpec(model="m", num_layers=3, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32")
    p_pool, d_pool = KVPool(spec, 32), KVPool(spec.with_kv_dtype(kind), 32)
    slots = torch.tensor([4, 1, 20])
    for layer in range(spec.num_layers):
        k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
        kernels.store_kv(k, v, *p_pool.layer(layer), slots)
        kernels.store_kv(k, v, *d_pool.layer(layer), slots, quant=kind)
    moved = convert_kv(kernels.gather_kv(p_pool.k_cache, p_pool.v_cache, slots), "float32", kind, HEAD_DIM)
    assert moved.dtype == torch.uint8
    assert moved.numel() == 3 * d_pool.spec.bytes_per_token
    assert torch.equal(moved, kernels.gather_kv(d_pool.k_cache, d_pool.v_cache, slots, d_pool.spec.row_width))
    back = convert_kv(moved, kind, "float32", HEAD_DIM)
    want = kernels.gather_kv(p_pool.k_cache, p_pool.v_cache, slots)
    assert (back - want).abs().max() <= TOLERANCE[kind] * want.abs().max()
    assert d_pool.k_scale is not None and d_pool.k_scale.shape == (3, 32, KV_HEADS, 1)


def test_quantized_spec_counts_values_and_scales() -> None:
    spec = KVSpec(model="m", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert spec.with_kv_dtype("int8").bytes_per_token == 2 * 30 * 3 * (64 + 4)
    assert spec.with_kv_dtype("fp8_e4m3").bytes_per_token == 2 * 30 * 3 * (64 + 4)
    # A pool stores each row padded to 16 bytes (the attention's loads); a handover moves 68.
    assert spec.with_kv_dtype("int8").pool_bytes_per_token == 2 * 30 * 3 * 80
    assert spec.pool_bytes_per_token == spec.bytes_per_token
    assert spec.mismatch(spec.with_kv_dtype("int8")) == []
    assert spec.mismatch(spec.model_copy(update={"head_dim": 32})) == ["head_dim"]
