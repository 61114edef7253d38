"""The torch references in ``kernels`` agree with plain dense math.

Attention is checked against causal softmax attention computed per sequence, in float64, on
that sequence's keys and values laid out contiguously; the paged inputs put those same keys
into scattered KV slots (shuffled, block-aligned, shared between sequences) and fill every
other slot with NaN, so reading a slot outside a sequence's table shows up in the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import kernels
from kernels.attention import context_attention_ref, decode_attention_ref
from kernels.kv_transfer import copy_kv_slots_ref, gather_kv_ref, scatter_kv_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rotary_cos_sin
from kernels.silu_mul import silu_mul_ref
from kernels.store_kv import store_kv_ref

LAYOUTS = ("contiguous", "shuffled", "blocks1", "blocks16")


# ---------------------------------------------------------------------------------------------
# Paged batches and dense attention (also used by the Triton tests).
# ---------------------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    """A ragged batch in the engine's layout, plus each sequence's keys/values in order."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_table: torch.Tensor
    ctx_lens: torch.Tensor
    q_lens: torch.Tensor
    q_start_loc: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def _allocate_slots(
    ctx_lens: list[int], num_slots: int, layout: str, shared: tuple[int, int, int] | None, gen: torch.Generator
) -> list[torch.Tensor]:
    """Slots for each sequence; ``shared=(src, dst, n)`` makes dst's first n slots src's."""
    block = {"blocks1": 1, "blocks16": 16}.get(layout, 1)
    if layout == "contiguous":
        pool = torch.arange(num_slots)
    elif layout == "shuffled":
        pool = torch.randperm(num_slots, generator=gen)
    else:
        blocks = torch.randperm(num_slots // block, generator=gen)
        pool = (blocks[:, None] * block + torch.arange(block)).flatten()
    tables: list[torch.Tensor] = []
    cursor = 0
    for b, ctx in enumerate(ctx_lens):
        reused = torch.empty(0, dtype=torch.int64)
        if shared is not None and shared[1] == b:
            src, _, n = shared
            assert n % block == 0 and n <= min(ctx_lens[src], ctx)
            reused = tables[src][:n]
        fresh = ctx - reused.numel()
        taken = math.ceil(fresh / block) * block  # a partial last block still owns the whole block
        tables.append(torch.cat((reused, pool[cursor : cursor + fresh])))
        cursor += taken + (block if layout == "contiguous" else 0)  # a gap between sequences
    assert cursor <= num_slots, "slot pool too small for this batch"
    return tables


def make_paged_batch(
    ctx_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    layout: str = "shuffled",
    shared: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    num_slots: int = 512,
    seed: int = 0,
    device: str = "cpu",
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    tables = _allocate_slots(ctx_lens, num_slots, layout, shared, gen)
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [], []
    for b, slots in enumerate(tables):
        k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
        if shared is not None and shared[1] == b:
            src, _, n = shared
            k[:n], v[:n] = keys[src][:n], values[src][:n]
        k_cache[slots], v_cache[slots] = k, v
        keys.append(k)
        values.append(v)
    # Padding past each context points far outside the cache: reading it is an error.
    slot_table = torch.full((len(ctx_lens), max(ctx_lens) + 5), 10 * num_slots, dtype=torch.int64)
    for b, slots in enumerate(tables):
        slot_table[b, : len(slots)] = slots
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        slot_table=slot_table.to(device),
        ctx_lens=as_tensor(ctx_lens),
        q_lens=as_tensor(q_lens),
        q_start_loc=as_tensor(starts),
        keys=keys,
        values=values,
    )


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Float64 attention of queries at the last ``len(q)`` positions of a contiguous context."""
    n, num_q_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        qh, kh, vh = q[:, h].double(), k[:, h // group].double(), v[:, h // group].double()
        scores = (qh @ kh.T) * sm_scale
        for i in range(n):
            visible = ctx - n + i + 1
            row = scores[i, :visible]
            weights = torch.exp(row - row.max())
            out[i, h] = (weights / weights.sum()) @ vh[:visible]
    return out


def expected_context_attention(batch: PagedBatch, sm_scale: float) -> torch.Tensor:
    out = torch.empty(batch.q.shape, dtype=torch.float64)
    q = batch.q.cpu()
    for b in range(len(batch.keys)):
        start, n = int(batch.q_start_loc[b]), int(batch.q_lens[b])
        out[start : start + n] = dense_causal_attention(q[start : start + n], batch.keys[b], batch.values[b], sm_scale)
    return out


def expected_decode_attention(q: torch.Tensor, batch: PagedBatch, sm_scale: float) -> torch.Tensor:
    q = q.cpu()
    return torch.cat(
        [dense_causal_attention(q[b : b + 1], batch.keys[b], batch.values[b], sm_scale) for b in range(q.shape[0])]
    )


# A ragged batch: a fresh prompt, prefix-only contexts (q_len < ctx_len), one new token, and a
# sequence with no new tokens this step.
CTX_LENS = [37, 21, 20, 50, 9]
Q_LENS = [37, 2, 1, 13, 0]
HEADS = [(4, 4), (6, 2), (8, 2)]  # (q heads, kv heads): GQA groups 1, 3, 4


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", HEADS)
def test_context_attention_matches_dense_causal_attention(layout: str, heads: tuple[int, int]) -> None:
    seed = 10 * LAYOUTS.index(layout) + HEADS.index(heads)
    batch = make_paged_batch(CTX_LENS, Q_LENS, *heads, 16, layout=layout, seed=seed)
    out = context_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.25
    )
    torch.testing.assert_close(out.double(), expected_context_attention(batch, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["shuffled", "blocks16"])
def test_context_attention_reads_a_prefix_shared_through_slot_tables(layout: str) -> None:
    # Sequence 2 reuses sequence 0's first 32 slots; both extend it differently.
    ctx_lens, q_lens = [40, 11, 45], [8, 11, 13]
    batch = make_paged_batch(ctx_lens, q_lens, 6, 2, 16, layout=layout, shared=(0, 2, 32), seed=3)
    assert torch.equal(batch.slot_table[0, :32], batch.slot_table[2, :32])
    assert not torch.equal(batch.keys[0][32:40], batch.keys[2][32:40])
    out = context_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.3
    )
    torch.testing.assert_close(out.double(), expected_context_attention(batch, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_attention_matches_dense_attention_at_the_last_position(layout: str, heads: tuple[int, int]) -> None:
    ctx_lens = [1, 33, 64, 17]
    batch = make_paged_batch(ctx_lens, [1] * 4, *heads, 16, layout=layout, seed=11)
    out = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
    torch.testing.assert_close(out.double(), expected_decode_attention(batch.q, batch, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_attention_equals_context_attention_with_one_query_each() -> None:
    batch = make_paged_batch([5, 30, 18], [1, 1, 1], 6, 2, 16, layout="blocks16", seed=12)
    dec = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.2)
    ctx = context_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.2
    )
    assert torch.equal(dec, ctx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_returns_the_query_dtype(dtype: torch.dtype) -> None:
    batch = make_paged_batch([10, 4], [3, 4], 4, 2, 16, dtype=dtype, seed=13)
    out = context_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.25
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected_context_attention(batch, 0.25), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# Rotary
# ---------------------------------------------------------------------------------------------

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _frequencies(head_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """Per-pair angular frequencies in float64, written the way the Llama 3.1 paper's code does."""
    freqs = [theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]
    if scaling is None:
        return freqs
    if scaling["rope_type"] == "linear":
        return [f / scaling["factor"] for f in freqs]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    scaled = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_len / high:
            scaled.append(f)
        elif wavelen > old_len / low:
            scaled.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return scaled


def _complex_rotation(x: torch.Tensor, positions: torch.Tensor, freqs: list[float]) -> torch.Tensor:
    """Rotate-half layout as complex numbers: pair (x[i], x[i + D/2]) turns by pos * freq[i]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    angle = positions.double()[:, None] * torch.tensor(freqs, dtype=torch.float64)[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["default", "linear", "llama3"]
)
def test_rotary_matches_complex_rotation(scaling: dict | None) -> None:
    head_dim, theta, max_pos = 64, 500000.0, 4096
    freqs = _frequencies(head_dim, theta, scaling)
    if scaling is LLAMA3:  # the three llama3 regimes all occur at this size
        wavelens = [2 * math.pi / f for f in _frequencies(head_dim, theta, None)]
        assert min(wavelens) < 2048 and max(wavelens) > 8192 and any(2048 <= w <= 8192 for w in wavelens)
    cos, sin = rotary_cos_sin(head_dim, max_pos, theta, scaling)
    gen = torch.Generator().manual_seed(5)
    positions = torch.cat((torch.tensor([0, 1, max_pos - 1]), torch.randint(0, max_pos, (13,), generator=gen)))
    q = torch.randn(16, 4, head_dim, generator=gen)
    k = torch.randn(16, 2, head_dim, generator=gen)
    q_out, k_out = apply_rotary_ref(q, k, positions, cos, sin)
    # float32 angles at position 4095 carry ~4e-4 rad of rounding, as transformers' tables do.
    torch.testing.assert_close(q_out.double(), _complex_rotation(q, positions, freqs), rtol=0, atol=3e-3)
    torch.testing.assert_close(k_out.double(), _complex_rotation(k, positions, freqs), rtol=0, atol=3e-3)
    near = positions < 64
    expected_near = _complex_rotation(q[near], positions[near], freqs)
    torch.testing.assert_close(q_out[near].double(), expected_near, rtol=0, atol=1e-5)


#: Every rope_scaling type a Llama-family config may carry (yarn with the fields Qwen3's long
#: context setting writes, and with DeepSeek-style mscales).
ROPE_SCALINGS = [
    {"rope_type": "default"},
    LLAMA3,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "mscale": 1.0,
     "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
]


@pytest.mark.parametrize("rope", ROPE_SCALINGS, ids=["default", "llama3", "linear", "dynamic", "yarn", "yarn-mscale"])
def test_rotary_matches_transformers_llama_rotary_embedding(rope: dict) -> None:
    head_dim, theta, max_pos = 64, 500000.0, 2048
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters={**rope, "rope_theta": theta},
    )
    hf_rope = LlamaRotaryEmbedding(config)
    scaling = None if rope["rope_type"] == "default" else config.rope_parameters
    cos, sin = rotary_cos_sin(head_dim, max_pos, theta, scaling)
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.arange(max_pos)[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)

    gen = torch.Generator().manual_seed(6)
    positions = torch.randint(0, max_pos, (12,), generator=gen)
    q = torch.randn(12, 4, head_dim, generator=gen)
    k = torch.randn(12, 2, head_dim, generator=gen)
    q_out, k_out = apply_rotary_ref(q, k, positions, cos, sin)
    hf_cos, hf_sin = hf_rope(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rotary_keeps_the_input_dtype() -> None:
    cos, sin = rotary_cos_sin(16, 32, 10000.0)
    q, k = torch.randn(3, 2, 16, dtype=torch.bfloat16), torch.randn(3, 1, 16, dtype=torch.bfloat16)
    q_out, k_out = apply_rotary_ref(q, k, torch.tensor([0, 5, 31]), cos, sin)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity


# ---------------------------------------------------------------------------------------------
# RMSNorm, SiLU-mul, KV store and transfer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_formula(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 96, generator=gen) * 3).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    residual = torch.randn(6, 96, generator=gen).to(dtype) if with_residual else None
    out, new_residual = rms_norm_ref(x, weight, 1e-5, residual)
    stream = x + residual if with_residual else x
    s = stream.double()
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    assert torch.equal(new_residual, stream)
    if not with_residual:
        assert new_residual is x


def test_silu_mul_matches_formula() -> None:
    gate_up = torch.randn(2, 5, 2 * 48, generator=torch.Generator().manual_seed(8)) * 4
    gate, up = gate_up.double()[..., :48], gate_up.double()[..., 48:]
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(silu_mul_ref(gate_up).double(), expected, rtol=1e-5, atol=1e-5)


def test_store_kv_writes_exactly_the_given_slots() -> None:
    k_cache = torch.full((20, 2, 8), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([17, 3, 0, 11, 19])
    store_kv_ref(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot], k[i].to(torch.bfloat16))
        assert torch.equal(v_cache[slot], v[i].to(torch.bfloat16))
    others = torch.ones(20, dtype=torch.bool)
    others[slots] = False
    assert torch.isnan(k_cache[others]).all() and torch.isnan(v_cache[others]).all()


def test_gather_kv_collects_every_layer_in_slot_order() -> None:
    k_cache, v_cache = torch.randn(3, 16, 2, 4), torch.randn(3, 16, 2, 4)
    slots = torch.tensor([9, 2, 15, 4])
    buffer = gather_kv_ref(k_cache, v_cache, slots)
    assert buffer.shape == (2, 3, 4, 2, 4)
    for layer in range(3):
        for i, slot in enumerate(slots.tolist()):
            assert torch.equal(buffer[0, layer, i], k_cache[layer, slot])
            assert torch.equal(buffer[1, layer, i], v_cache[layer, slot])


def test_scatter_kv_inverts_gather_into_other_slots() -> None:
    gen = torch.Generator().manual_seed(9)
    src_k, src_v = torch.randn(4, 32, 3, 8, generator=gen), torch.randn(4, 32, 3, 8, generator=gen)
    src_slots = torch.tensor([5, 6, 7, 30, 1])
    dst_k, dst_v = torch.randn(4, 24, 3, 8, generator=gen), torch.randn(4, 24, 3, 8, generator=gen)
    untouched_k, untouched_v = dst_k.clone(), dst_v.clone()
    dst_slots = torch.tensor([20, 0, 13, 2, 9])
    scatter_kv_ref(gather_kv_ref(src_k, src_v, src_slots), dst_k, dst_v, dst_slots)
    assert torch.equal(dst_k[:, dst_slots], src_k[:, src_slots])
    assert torch.equal(dst_v[:, dst_slots], src_v[:, src_slots])
    rest = torch.ones(24, dtype=torch.bool)
    rest[dst_slots] = False
    assert torch.equal(dst_k[:, rest], untouched_k[:, rest]) and torch.equal(dst_v[:, rest], untouched_v[:, rest])
    assert torch.equal(gather_kv_ref(dst_k, dst_v, dst_slots), gather_kv_ref(src_k, src_v, src_slots))


def test_copy_kv_slots_moves_only_the_listed_slots_between_pools() -> None:
    gen = torch.Generator().manual_seed(10)
    src_k, src_v = torch.randn(4, 32, 3, 8, generator=gen), torch.randn(4, 32, 3, 8, generator=gen)
    dst_k, dst_v = torch.randn(4, 24, 3, 8, generator=gen), torch.randn(4, 24, 3, 8, generator=gen)
    untouched_k, untouched_v = dst_k.clone(), dst_v.clone()
    src_slots, dst_slots = torch.tensor([3, 31, 0, 8]), torch.tensor([23, 1, 7, 4])
    copy_kv_slots_ref(src_k, src_v, src_slots, dst_k, dst_v, dst_slots)
    assert torch.equal(gather_kv_ref(dst_k, dst_v, dst_slots), gather_kv_ref(src_k, src_v, src_slots))
    rest = torch.ones(24, dtype=torch.bool)
    rest[dst_slots] = False
    assert torch.equal(dst_k[:, rest], untouched_k[:, rest]) and torch.equal(dst_v[:, rest], untouched_v[:, rest])


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


def test_public_ops_run_the_reference_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a Triton launcher ran for CPU tensors")

    for module, launchers in {
        "kernels.attention": ["context_attention_triton", "decode_attention_triton"],
        "kernels.kv_transfer": ["gather_kv_triton", "scatter_kv_triton", "copy_kv_slots_triton"],
        "kernels.rms_norm": ["rms_norm_triton"],
        "kernels.rotary": ["apply_rotary_triton", "rotary_store_kv_triton"],
        "kernels.silu_mul": ["silu_mul_triton"],
        "kernels.store_kv": ["store_kv_triton"],
        "kernels.gemv": ["norm_linear_triton", "silu_linear_triton", "linear_triton"],
        "kernels.qkv_rotary": ["norm_qkv_rotary_triton"],
    }.items():
        for name in launchers:
            monkeypatch.setattr(importlib.import_module(module), name, refuse)

    batch = make_paged_batch([6, 3], [2, 3], 4, 2, 8, seed=10)
    args = (batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens)
    kernels.context_attention(batch.q, *args, batch.q_lens, batch.q_start_loc, 0.5)
    kernels.decode_attention(batch.q[:2], *args, 0.5)
    out, _ = kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(2, 8))
    cos, sin = kernels.rotary_cos_sin(8, 16, 10000.0)
    kernels.apply_rotary(batch.q, batch.q[:, :2], torch.arange(5), cos, sin)
    kernels.silu_mul(torch.randn(3, 8))
    kernels.store_kv(batch.q[:, :2], batch.q[:, :2], batch.k_cache, batch.v_cache, torch.arange(5))
    kernels.rotary_store_kv(batch.q, batch.q[:, :2], batch.q[:, :2], torch.arange(5), cos, sin, batch.k_cache,
                            batch.v_cache, torch.arange(5))
    x, weight = torch.randn(1, 8), torch.randn(6 * 8, 8)  # 4 q heads and 1 kv head of 8
    kernels.norm_linear(x, x, torch.ones(8), 1e-6, weight)
    kernels.norm_qkv_rotary(x, x, torch.ones(8), 1e-6, weight, None, torch.arange(1), cos, sin,
                            batch.k_cache[:, :1], batch.v_cache[:, :1], torch.arange(1), 4, 1)
    buffer = kernels.gather_kv(batch.k_cache[None], batch.v_cache[None], torch.arange(3))
    kernels.scatter_kv(buffer, batch.k_cache[None], batch.v_cache[None], torch.arange(3))
    kernels.copy_kv_slots(batch.k_cache[None], batch.v_cache[None], torch.arange(3),
                          batch.k_cache[None], batch.v_cache[None], torch.arange(3))
    assert out.shape == (2, 8)


@pytest.mark.parametrize("group", [1, 3])
def test_cpu_attention_paths_match_the_references(group):
    """The vectorized CPU paths (what the engine runs on CPU) agree with the references."""
    from kernels.attention import (
        context_attention_cpu,
        context_attention_ref,
        decode_attention_cpu,
        decode_attention_ref,
    )

    gen = torch.Generator().manual_seed(11)
    slots_total, kv_heads, head_dim = 300, 2, 16
    k_cache = torch.randn(slots_total, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots_total, kv_heads, head_dim, generator=gen)
    ctx_lens = torch.tensor([1, 37, 90, 5])
    q_lens = torch.tensor([1, 5, 90, 2])
    q_start = torch.cumsum(q_lens, 0) - q_lens
    table = torch.stack([torch.randperm(slots_total, generator=gen)[:96] for _ in range(4)])
    q = torch.randn(int(q_lens.sum()), kv_heads * group, head_dim, generator=gen)
    want = context_attention_ref(q, k_cache, v_cache, table, ctx_lens, q_lens, q_start, 0.25)
    got = context_attention_cpu(q, k_cache, v_cache, table, ctx_lens, q_lens, q_start, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    q1 = torch.randn(4, kv_heads * group, head_dim, generator=gen)
    # Ragged lengths take the per-sequence path, similar ones the padded batch: check both.
    for lens in (ctx_lens, torch.tensor([90, 88, 95, 96])):
        want = decode_attention_ref(q1, k_cache, v_cache, table, lens, 0.25)
        got = decode_attention_cpu(q1, k_cache, v_cache, table, lens, 0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
