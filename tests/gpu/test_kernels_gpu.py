"""Triton kernels on a CUDA device against the torch references, at model-sized shapes.

Needs only torch, triton and ``kernels`` (no other package of this project), so it runs on a
bare GPU image: ``python -m pytest -q -m gpu -p no:cacheprovider --noconftest tests/gpu/test_kernels_gpu.py``.
Running this file as a script prints kernel timings.

Errors are ``‖out − ref‖ / ‖ref‖``, the attention reference computed in float32 from the same inputs:
float32 kernels land far under 1e-4, bfloat16 ones between 1e-3 and 1e-2 (their products take
bfloat16 operands, and the outputs are rounded to bfloat16). NaN never passes. Outputs are
allocated NaN-filled and unused KV slots hold NaN, so unwritten elements and stray reads fail.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch

import kernels
from kernels import gemv, qkv_rotary
from kernels.attention import (
    context_attention_ref,
    context_attention_triton,
    decode_attention_ref,
    decode_attention_triton,
)
from kernels.head_norm import head_rms_norm_triton
from kernels.kv_transfer import gather_kv_ref, gather_kv_triton, scatter_kv_ref, scatter_kv_triton
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.rotary import apply_rotary_ref, apply_rotary_triton, rotary_cos_sin
from kernels.silu_mul import silu_mul_ref, silu_mul_triton
from kernels.store_kv import store_kv_ref, store_kv_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float32]
# Relative error bounds: elementwise kernels round like the references (a stray ulp in bf16).
ELEMENTWISE_TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-3}
ATTENTION_TOL = {torch.float32: 5e-5, torch.bfloat16: 1e-2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip
# (q heads, kv heads, head dim): Llama 3 8B (group 4), SmolLM2-135M (group 3, head dim 64).
ATTENTION_HEADS = [(32, 8, 128), (9, 3, 64)]


def _nan_filled(alloc: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = alloc(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    return poisoned


@pytest.fixture(autouse=True)
def nan_filled_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers allocate with ``torch.empty*``: any element a kernel leaves unwritten stays NaN."""
    monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the output"
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


class Paged:
    """A ragged batch over a NaN-filled KV cache, slots assigned token by token or in blocks."""

    def __init__(
        self,
        ctx_lens: list[int],
        q_lens: list[int],
        heads: tuple[int, int, int],
        dtype: torch.dtype,
        *,
        block_size: int = 1,
        shared: tuple[int, int, int] | None = None,
        seed: int = 0,
    ) -> None:
        num_q_heads, num_kv_heads, head_dim = heads
        gen = torch.Generator(device="cuda").manual_seed(seed)
        num_blocks = sum(math.ceil(c / block_size) for c in ctx_lens) * 2 + 8
        num_slots = num_blocks * block_size
        blocks = torch.randperm(num_blocks, device="cuda", generator=gen)
        pool = (blocks[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()
        self.k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.slot_table = torch.full((len(ctx_lens), max(ctx_lens) + 3), -1, dtype=torch.int64, device="cuda")
        cursor = 0
        for b, ctx in enumerate(ctx_lens):
            reused = 0
            if shared is not None and shared[1] == b:  # (src, dst, n): dst's first n slots are src's
                reused = shared[2]
                self.slot_table[b, :reused] = self.slot_table[shared[0], :reused]
            fresh = ctx - reused
            slots = pool[cursor : cursor + fresh]
            cursor += math.ceil(fresh / block_size) * block_size
            self.slot_table[b, reused:ctx] = slots
            shape = (fresh, num_kv_heads, head_dim)
            self.k_cache[slots] = torch.randn(shape, device="cuda", generator=gen).to(dtype)
            self.v_cache[slots] = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        self.q = torch.randn((sum(q_lens), num_q_heads, head_dim), device="cuda", generator=gen).to(dtype)
        self.ctx_lens = torch.tensor(ctx_lens, device="cuda")
        self.q_lens = torch.tensor(q_lens, device="cuda")
        self.q_start_loc = torch.cumsum(self.q_lens, 0) - self.q_lens
        self.sm_scale = head_dim**-0.5

    def context_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.slot_table, self.ctx_lens, self.q_lens, self.q_start_loc,
                self.sm_scale)  # fmt: skip

    def decode_args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.slot_table, self.ctx_lens, self.sm_scale


def _upcast(args: tuple) -> tuple:
    """The same arguments with floating tensors in float32, for the reference."""
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


# ---------------------------------------------------------------------------------------------
# Elementwise and copies
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = torch.randn(4096, hidden, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    residual = torch.randn(4096, hidden, device="cuda").to(dtype) if with_residual else None
    out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert rel_error(out, ref_out) < ELEMENTWISE_TOL[dtype]
    assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm_on_a_split_qkv(dtype: torch.dtype) -> None:
    tokens, hq, hkv, head_dim = 4096, 32, 4, 128
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    weight = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    for heads in (q, k):
        got = head_rms_norm_triton(heads, weight, 1e-6)
        want, _ = rms_norm_triton(heads.reshape(-1, head_dim).contiguous(), weight, 1e-6)
        assert got.is_contiguous() and rel_error(got.view(-1, head_dim), want) < ELEMENTWISE_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_on_a_split_qkv(dtype: torch.dtype) -> None:
    tokens, hq, hkv, head_dim = 4096, 32, 8, 128
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    cos, sin = rotary_cos_sin(head_dim, 16384, 500000.0, LLAMA3, device="cuda")
    positions = torch.randint(0, 16384, (tokens,), device="cuda")
    q_out, k_out = apply_rotary_triton(q, k, positions, cos, sin)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cos, sin)
    assert rel_error(q_out, q_ref) < ELEMENTWISE_TOL[dtype]
    assert rel_error(k_out, k_ref) < ELEMENTWISE_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    gate_up = (2 * torch.randn(2048, 2 * 14336, device="cuda")).to(dtype)
    assert rel_error(silu_mul_triton(gate_up), silu_mul_ref(gate_up)) < ELEMENTWISE_TOL[dtype]


# The default model's projections (qkv, o, gate/up, down, the vocabulary head), and an 8B shape's,
# whose long rows go in blocks of 1024.
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
               (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
PROJECTION_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", PROJECTIONS)
def test_fused_projections_match_the_unfused_ops(dtype: torch.dtype, rows: int, shape: tuple[int, int]) -> None:
    n, k = shape
    x, residual = torch.randn(rows, k, device="cuda").to(dtype), torch.randn(rows, k, device="cuda").to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    weight = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    out, new_residual = gemv.norm_linear_triton(x, residual, norm_weight, 1e-5, weight)
    ref, ref_residual = gemv.norm_linear_ref(x, residual, norm_weight, 1e-5, weight)
    assert rel_error(out, ref) < PROJECTION_TOL[dtype]
    assert torch.equal(new_residual, ref_residual)
    gate_up = (2 * torch.randn(rows, 2 * k, device="cuda")).to(dtype)
    silu_out = gemv.silu_linear_triton(gate_up, weight)
    assert rel_error(silu_out, gemv.silu_linear_ref(gate_up, weight)) < PROJECTION_TOL[dtype]
    assert rel_error(gemv.linear_triton(x, weight), gemv.linear_ref(x, weight)) < PROJECTION_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("heads", "hidden"), [((9, 3, 64), 576), ((32, 8, 128), 4096)])
def test_qkv_projection_with_rotary_and_kv_store(dtype: torch.dtype, rows: int, heads: tuple[int, int, int],
                                                 hidden: int) -> None:
    hq, hkv, head_dim = heads
    x, residual = torch.randn(rows, hidden, device="cuda").to(dtype), torch.randn(rows, hidden, device="cuda").to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    weight = (torch.randn((hq + 2 * hkv) * head_dim, hidden, device="cuda") * hidden**-0.5).to(dtype)
    cos, sin = rotary_cos_sin(head_dim, 8192, 100000.0, device="cuda")
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:rows]
    caches = [torch.full((64, hkv, head_dim), float("nan"), dtype=dtype, device="cuda") for _ in range(4)]
    args = (x, residual, norm_weight, 1e-5, weight, None, positions, cos, sin)
    q, new_residual = qkv_rotary.norm_qkv_rotary_triton(*args, caches[0], caches[1], slots, hq, hkv)
    q_ref, ref_residual = qkv_rotary.norm_qkv_rotary_ref(*args, caches[2], caches[3], slots, hq, hkv)
    assert rel_error(q, q_ref) < PROJECTION_TOL[dtype]
    assert torch.equal(new_residual, ref_residual)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.isnan(got).sum() == torch.isnan(want).sum() == (64 - rows) * hkv * head_dim
        assert rel_error(got[slots], want[slots]) < PROJECTION_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_the_same_slots_as_the_reference(dtype: torch.dtype) -> None:
    tokens, hkv, head_dim, num_slots = 4096, 8, 128, 65536
    kv = torch.randn(tokens, 2 * hkv * head_dim, device="cuda")  # float32, cast into the cache
    k, v = kv[:, : hkv * head_dim].view(tokens, hkv, head_dim), kv[:, hkv * head_dim :].view(tokens, hkv, head_dim)
    slots = torch.randperm(num_slots, device="cuda")[:tokens]
    caches = [torch.full((num_slots, hkv, head_dim), float("nan"), dtype=dtype, device="cuda") for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter_kv_round_trip(dtype: torch.dtype) -> None:
    layers, num_slots, hkv, head_dim, n = 16, 16384, 8, 128, 4096
    k_cache = torch.randn(layers, num_slots, hkv, head_dim, device="cuda").to(dtype)
    v_cache = torch.randn(layers, num_slots, hkv, head_dim, device="cuda").to(dtype)
    slots = torch.randperm(num_slots, device="cuda")[:n]
    buffer = gather_kv_triton(k_cache, v_cache, slots)
    assert torch.equal(buffer, gather_kv_ref(k_cache, v_cache, slots))
    dst_slots = torch.randperm(num_slots, device="cuda")[:n]
    got = [torch.randn_like(k_cache), torch.randn_like(v_cache)]
    want = [t.clone() for t in got]
    scatter_kv_triton(buffer, got[0], got[1], dst_slots)
    scatter_kv_ref(buffer, want[0], want[1], dst_slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

# Fresh prompts (q_len == ctx_len), cached prefixes (q_len < ctx_len), single new tokens.
CTX_LENS = [2048, 1500, 513, 100, 4096, 1, 777, 3000]
Q_LENS = [2048, 300, 513, 1, 1024, 1, 7, 3000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", ATTENTION_HEADS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_context_attention(dtype: torch.dtype, heads: tuple[int, int, int], block_size: int) -> None:
    batch = Paged(CTX_LENS, Q_LENS, heads, dtype, block_size=block_size, seed=1)
    out = context_attention_triton(*batch.context_args())
    ref = context_attention_ref(*_upcast(batch.context_args()))
    assert out.dtype == dtype and rel_error(out, ref) < ATTENTION_TOL[dtype]


@pytest.mark.parametrize("tiles", [(128, 64, 8), (64, 64, 8), (16, 16, 4)])
def test_context_attention_with_other_tilings(tiles: tuple[int, int, int]) -> None:
    block_m, block_n, num_warps = tiles
    batch = Paged(CTX_LENS, Q_LENS, (9, 3, 64), torch.bfloat16, block_size=16, seed=6)
    out = context_attention_triton(*batch.context_args(), block_m=block_m, block_n=block_n, num_warps=num_warps)
    ref = context_attention_ref(*_upcast(batch.context_args()))
    assert rel_error(out, ref) < ATTENTION_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_context_attention_with_a_shared_prefix(dtype: torch.dtype) -> None:
    # Sequence 2 extends the first 1024 slots of sequence 0 (a prefix-cache hit).
    batch = Paged([1100, 64, 1500], [76, 64, 476], (32, 8, 128), dtype, block_size=16, shared=(0, 2, 1024), seed=2)
    out = context_attention_triton(*batch.context_args())
    ref = context_attention_ref(*_upcast(batch.context_args()))
    assert out.dtype == dtype and rel_error(out, ref) < ATTENTION_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", ATTENTION_HEADS)
@pytest.mark.parametrize("batch_size", [3, 64])
def test_decode_attention(dtype: torch.dtype, heads: tuple[int, int, int], batch_size: int) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    ctx_lens = [1, 8192] + torch.randint(1, 8192, (batch_size - 2,), generator=gen).tolist()
    batch = Paged(ctx_lens, [1] * batch_size, heads, dtype, block_size=16, seed=3)
    out = decode_attention_triton(*batch.decode_args())
    ref = decode_attention_ref(*_upcast(batch.decode_args()))
    assert out.dtype == dtype and rel_error(out, ref) < ATTENTION_TOL[dtype]


@pytest.mark.parametrize(("num_splits", "block_n", "num_warps"), [(1, None, None), (7, 64, 8), (64, 128, 4)])
def test_decode_attention_any_split_count_and_tiling(
    num_splits: int, block_n: int | None, num_warps: int | None
) -> None:
    batch = Paged([5, 4000, 700, 129], [1] * 4, (32, 8, 128), torch.bfloat16, seed=4)
    out = decode_attention_triton(*batch.decode_args(), num_splits=num_splits, block_n=block_n, num_warps=num_warps)
    ref = decode_attention_ref(*_upcast(batch.decode_args()))
    assert rel_error(out, ref) < ATTENTION_TOL[torch.bfloat16]


def test_decode_attention_replays_in_a_cuda_graph() -> None:
    batch = Paged([3000, 17, 900, 2048], [1] * 4, (32, 8, 128), torch.bfloat16, seed=5)
    args = list(batch.decode_args())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.decode_attention(*args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels.decode_attention(*args)
    # Next step: every context one token longer, new queries, written in place.
    args[4].add_(1)
    for b, ctx in enumerate(args[4].tolist()):
        batch.slot_table[b, ctx - 1] = batch.slot_table[b, ctx - 2]  # a slot that holds keys
    batch.q.copy_(torch.randn_like(batch.q))
    graph.replay()
    ref = decode_attention_ref(*_upcast(tuple(args)))
    assert rel_error(static_out.clone(), ref) < ATTENTION_TOL[torch.bfloat16]


def test_argmax_in_a_cuda_graph_stores_ids_into_the_pinned_row_each_replay_names() -> None:
    """The row of pinned host memory is read from the device when the graph runs, so one capture
    writes where each replay's input says; the host sees the ids once the stream has passed it."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(3, 49152, device="cuda", generator=gen)
    out = torch.empty(3, dtype=torch.int64, device="cuda")
    host_out = torch.full((4, 3), -1, dtype=torch.int64).pin_memory()
    host_row = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.argmax_rows(logits, out=out, host_out=host_out, host_row=host_row)  # compile outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.argmax_rows(logits, out=out, host_out=host_out, host_row=host_row)
    host_out.fill_(-1)
    for row in (2, 1, 3):
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
        host_row.fill_(row)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert host_out[row].tolist() == logits.argmax(dim=-1).tolist() == out.tolist()
    assert host_out[0].tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="pinned"):
        kernels.argmax_rows(logits, host_out=torch.zeros(2, 3, dtype=torch.int64), host_row=host_row)


def test_public_ops_dispatch_to_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a torch reference ran for CUDA tensors")

    for module, refs in {
        "kernels.attention": ["context_attention_ref", "decode_attention_ref"],
        "kernels.head_norm": ["head_rms_norm_ref"],
        "kernels.kv_transfer": ["gather_kv_ref", "scatter_kv_ref"],
        "kernels.rms_norm": ["rms_norm_ref"],
        "kernels.rotary": ["apply_rotary_ref"],
        "kernels.silu_mul": ["silu_mul_ref"],
        "kernels.store_kv": ["store_kv_ref"],
    }.items():
        for name in refs:
            monkeypatch.setattr(importlib.import_module(module), name, refuse)
    batch = Paged([40, 9], [40, 1], (8, 2, 64), torch.bfloat16)
    kernels.context_attention(*batch.context_args())
    kernels.decode_attention(batch.q[:2], *batch.decode_args()[1:])
    kernels.rms_norm(batch.q[:, 0], torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6, batch.q[:, 1])
    kernels.head_rms_norm(batch.q, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)
    cos, sin = kernels.rotary_cos_sin(64, 64, 10000.0, device="cuda")
    kernels.apply_rotary(batch.q, batch.q[:, :2], torch.arange(41, device="cuda"), cos, sin)
    kernels.silu_mul(batch.q[:, 0])
    kernels.store_kv(batch.q[:, :2], batch.q[:, :2], batch.k_cache, batch.v_cache, torch.arange(41, device="cuda"))
    buffer = kernels.gather_kv(batch.k_cache[None], batch.v_cache[None], torch.arange(3, device="cuda"))
    kernels.scatter_kv(buffer, batch.k_cache[None], batch.v_cache[None], torch.arange(3, device="cuda"))
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Timings (python tests/gpu/test_kernels_gpu.py)
# ---------------------------------------------------------------------------------------------


def _timings() -> None:
    """Median times of each kernel at model sizes, with the rate that bounds it (bf16)."""
    from triton.testing import do_bench

    def bench(name: str, fn: Callable[[], object], amount: float, unit: str) -> None:
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        scale = 1e6 if unit == "GB/s" else 1e9  # bytes or flops per ms
        print(f"{name:44s} {ms * 1000:9.1f} us {amount / ms / scale:8.0f} {unit}", flush=True)

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    bench("device copy 1 GiB (read + write)", lambda: dst.copy_(src), 2 * src.numel(), "GB/s")
    heads = (32, 8, 128)
    for batch_size, ctx in ((64, 4096), (8, 16384), (256, 1024)):
        batch = Paged([ctx] * batch_size, [1] * batch_size, heads, torch.bfloat16, block_size=16)
        kv_bytes = 2 * batch_size * ctx * 8 * 128 * 2
        for block_n, warps in ((None, None), (64, 4)):
            bench(f"decode B={batch_size} ctx={ctx} n={block_n} w={warps}",
                  lambda: decode_attention_triton(*batch.decode_args(), block_n=block_n, num_warps=warps),
                  kv_bytes, "GB/s")  # fmt: skip
    for n_seq, ctx, q_len in ((4, 4096, 4096), (8, 8192, 512)):
        batch = Paged([ctx] * n_seq, [q_len] * n_seq, heads, torch.bfloat16, block_size=16)
        flops = 4 * n_seq * 32 * 128 * q_len * (ctx - q_len / 2)  # QK^T and PV over the visible keys
        for block_m, block_n, warps in ((None, None, None), (128, 64, 8)):
            bench(f"prefill {n_seq}x(ctx {ctx}, new {q_len}) m={block_m} n={block_n} w={warps}",
                  lambda: context_attention_triton(*batch.context_args(), block_m=block_m, block_n=block_n,
                                                   num_warps=warps),
                  flops, "TFLOP/s")  # fmt: skip
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    bench("rms_norm + residual 8192x4096", lambda: rms_norm_triton(x, w, 1e-5, r), 4 * x.numel() * 2, "GB/s")
    gu = torch.randn(8192, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    bench("silu_mul 8192x14336", lambda: silu_mul_triton(gu), 1.5 * gu.numel() * 2, "GB/s")
    qkv = torch.randn(8192, 48 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, : 32 * 128].view(-1, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(-1, 8, 128)
    cos, sin = rotary_cos_sin(128, 8192, 500000.0, LLAMA3, device="cuda")
    pos = torch.randint(0, 8192, (8192,), device="cuda")
    bench("apply_rotary 8192 tokens 32+8 heads", lambda: apply_rotary_triton(q, k, pos, cos, sin),
          2 * 2 * 40 * 128 * 8192, "GB/s")  # fmt: skip
    k_cache = torch.empty(32, 65536, 8, 128, device="cuda", dtype=torch.bfloat16).normal_()
    v_cache = torch.empty_like(k_cache).normal_()
    slots = torch.randperm(65536, device="cuda")[:8192]
    bench("gather_kv 32 layers x 8192 slots", lambda: gather_kv_triton(k_cache, v_cache, slots),
          2 * 2 * 32 * 8192 * 8 * 128 * 2, "GB/s")  # fmt: skip


if __name__ == "__main__":
    _timings()
