"""Every Triton launcher in ``kernels`` matches its torch reference, run by Triton's interpreter.

Triton decides per ``@triton.jit`` function, when the decorator runs, whether it is compiled or
interpreted, and its own library (``tl.sum``, ``tl.cdiv``...) is decorated when Triton is
imported. So ``TRITON_INTERPRET=1`` must be set before anything imports Triton, which in one
pytest session is never guaranteed (``kernels`` imports it), and setting it process-wide would
leak into every later test module. Hence two modes:

* ``TRITON_INTERPRET=1`` already set when this module loads (a child process, or a CI job
  that sets it for the whole run): the cases in :class:`InterpretedCases` are collected.
* otherwise: one test runs this file in a child pytest with the variable set, and passes when
  every case there passed.

Outputs are allocated NaN-filled and unused KV slots hold NaN, so an element a kernel leaves
unwritten, or a slot it reads outside a sequence's table, shows up as a failure.

The interpreter has no bfloat16 arithmetic (it computes on the raw bits, and rounds float32 to
bfloat16 by truncation), so attention, whose dots take their operands as they are, runs here in
float32 and float16, and the elementwise kernels, which upcast first, in bfloat16 too with a
few-ulp tolerance. bfloat16 attention is covered by ``tests/gpu/test_kernels_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import pytest
import torch

from kernels.argmax import SLICE as ARGMAX_SLICE
from kernels.argmax import argmax_rows_ref, argmax_rows_triton, choose_ids_ref, choose_ids_triton
from kernels.attention import (
    context_attention_ref,
    context_attention_triton,
    decode_attention_codes_triton,
    decode_attention_ref,
    decode_attention_triton,
)
from kernels.kv_quant import QUANT_MAX, packed_row_bytes, quantize_rows, row_bytes
from kernels.kv_transfer import (
    copy_kv_slots_ref,
    copy_kv_slots_triton,
    gather_kv_ref,
    gather_kv_triton,
    scatter_kv_ref,
    scatter_kv_triton,
)
from kernels.gemv import MAX_ROWS as MAX_GEMV_ROWS
from kernels.gemv import (
    QUANT_TILES,
    linear_ref,
    linear_triton,
    norm_linear_ref,
    norm_linear_triton,
    quant_projection_config,
    quant_projection_heuristic,
    quant_projection_loads,
    silu_linear_ref,
    silu_linear_triton,
)
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.rotary import (
    apply_rotary_ref,
    apply_rotary_triton,
    rotary_cos_sin,
    rotary_store_kv_ref,
    rotary_store_kv_triton,
)
from kernels.penalties import apply_penalties_ref, apply_penalties_triton
from kernels.quant_matmul import (
    GemmConfig,
    act_quant_fp8_ref,
    act_quant_fp8_triton,
    weight_only_linear_triton,
)
from kernels.qkv_rotary import norm_qkv_rotary_ref, norm_qkv_rotary_triton
from kernels.sampling import filtered_weights_ref, sample_filtered_ref, sample_filtered_triton
from kernels.silu_mul import silu_mul_ref, silu_mul_triton
from kernels.step_inputs import embed_step_inputs_ref, embed_step_inputs_triton
from kernels.store_kv import store_kv_ref, store_kv_triton
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter
from tests.kernels.test_kernels import CTX_LENS, Q_LENS, PagedBatch, make_paged_batch

KERNEL_MODULES = ["kernels.argmax", "kernels.attention", "kernels.attention_context", "kernels.attention_decode",
                  "kernels.kv_transfer", "kernels.rms_norm", "kernels.rotary",
                  "kernels.silu_mul", "kernels.store_kv", "kernels.sampling", "kernels.penalties",
                  "kernels.gemv", "kernels.qkv_rotary", "kernels._triton", "kernels.step_inputs",
                  "kernels.quant_matmul", "kernels.fp8_gemm", "kernels._gemv_blocks", "kernels.qkv_epilogue",
                  "kernels._rotary_epilogue"]  # fmt: skip
# rms_norm, rotary, store_kv, silu_mul, the KV copy, context attention, its merge and their two tile
# helpers (the tile's sequence, its rows), decode split and merges (by q head, and into an FP8
# projection's codes), the sampling kernel and its two
# helpers (a row block, the stream hash), the penalties, the few-row projection, its products (the
# first weight tile, as float and as stored, the norm's tile, the products after the wait) and
# their float16-pair products (the code words, the inputs in fours, a float16 pair, the fp8 and
# int8 products of eight codes, a word's code, the runs' units, the products), the qkv projection
# with rotary and KV store, the
# dependent-launch wait, the argmax's two launches (a slice's winner, the row's), a captured step's
# inputs, the per-token FP8 activation quantization, the weight-only 8-bit GEMM, the FP8 GEMM and its
# split-K sum; the split-K sum that finishes a qkv projection, and the rotary epilogue's helpers (the
# tile's columns, a pair's rotation, a head's store and its halves', a tile's finish).
NUM_KERNELS = 51


def _nan_filled(alloc: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = alloc(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    return poisoned


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rel: float, max_abs: float) -> None:
    """``‖out − ref‖ / ‖ref‖ <= rel`` and no element further than ``max_abs``; NaN never passes."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element, or a read of a poisoned slot)"
    diff = (out.double() - ref.double()).abs()
    err = diff.norm() / ref.double().norm().clamp_min(1e-30)
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"
    assert diff.max() <= max_abs, f"max abs error {diff.max():.2e} > {max_abs:.0e}"


def assert_close_elementwise(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Elementwise kernels round like the references, but the interpreter truncates to bfloat16,
    up to three times in rms_norm with a residual: a few bfloat16 ulps (2**-8 relative each)."""
    rtol, atol = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (3e-2, 1e-5)}[ref.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)  # NaN fails here


# Projections: the sums run in another order than torch's, and in bfloat16 the interpreter
# truncates the normalised inputs where the reference rounds them (two ulps of outputs up to 16).
GEMV_TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1.3e-1)}

# 8-bit weights: in bfloat16 the reference rounds the unscaled product before scaling it (the
# kernel rounds once, after the scale).
QUANT_GEMV_TOL = {torch.float32: GEMV_TOL[torch.float32], torch.bfloat16: (2e-2, 1.3e-1)}

# The weight-only GEMM: float32 as the projections; float16 one rounding against two (above).
WEIGHT_ONLY_TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2)}

# The projection then the rotation: two bfloat16 truncations in the interpreter where the
# reference rounds twice (a rotated output mixes two truncated inputs).
QKV_ROTARY_TOL = {torch.float32: GEMV_TOL[torch.float32], torch.bfloat16: (2e-2, 1.3e-1)}

# Attention: float16 probabilities enter the second product, as in every flash kernel.
ATTENTION_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-2)}

# Attention over quantized KV: the kernel and the reference read the same bytes (the reference
# dequantizes them into float32 first, the kernel scales each key's scores and each value's
# weights), so they differ by float32 rounding, and in float16 by the probabilities' rounding as
# above (measured: float32 2e-7 relative, 7e-7 at most; float16 4e-4 and 2e-3).
QUANT_KINDS = ["int8", "fp8_e4m3"]
# bfloat16 q over fp8 codes (taken as float16): the interpreter truncates the output to bfloat16
# (2**-7 relative at most) where the reference rounds it.
QUANT_BF16_TOL = (1e-2, 2e-2)


def _quantized(batch: PagedBatch, kind: str) -> PagedBatch:
    """``batch`` with its caches as packed ``kind`` rows; every slot outside the sequences' tables
    holds 0xFF bytes (a NaN scale), so reading one shows up as NaN."""
    num_slots = batch.k_cache.shape[0]
    used = torch.zeros(num_slots, dtype=torch.bool)
    used[batch.slot_table[batch.slot_table < num_slots]] = True
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        packed = quantize_rows(cache.float().nan_to_num(0.0), kind)
        packed[~used] = 255
        caches.append(packed)
    return dataclasses.replace(batch, k_cache=caches[0], v_cache=caches[1])


def _context(batch: PagedBatch, q: torch.Tensor | None = None, quant: str | None = None,
             **blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = batch.q if q is None else q
    args = (q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.3)
    return context_attention_triton(*args, quant=quant, **blocks), context_attention_ref(*args, quant=quant)


class InterpretedCases:
    """Collected only where TRITON_INTERPRET=1 was set before Triton was imported."""

    @pytest.fixture(autouse=True)
    def nan_filled_outputs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Launchers allocate with ``torch.empty*``: any element a kernel leaves unwritten stays NaN."""
        monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
        monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))

    def test_every_kernel_runs_in_the_interpreter(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        found = {"interpreted": 0, "compiled": 0}
        for name in KERNEL_MODULES:
            for value in vars(importlib.import_module(name)).values():
                if getattr(getattr(value, "fn", None), "__module__", name) != name:
                    continue  # imported from another kernel module, counted there
                if isinstance(value, InterpretedFunction):
                    found["interpreted"] += 1
                elif isinstance(value, JITFunction):
                    found["compiled"] += 1
        assert found == {"interpreted": NUM_KERNELS, "compiled": 0}

    # ---------------------------------------------------------------------------------------------
    # Elementwise and copies
    # ---------------------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    @pytest.mark.parametrize("with_residual", [False, True])
    def test_rms_norm_triton_matches_reference(self, dtype: torch.dtype, with_residual: bool) -> None:
        gen = torch.Generator().manual_seed(1)
        # A strided view, as a slice of a wider activation would be; 72 is no power of two.
        x = (torch.randn(5, 100, generator=gen) * 2).to(dtype)[:, :72]
        weight = torch.randn(72, generator=gen).to(dtype)
        residual = torch.randn(5, 72, generator=gen).to(dtype) if with_residual else None
        out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
        ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
        assert_close_elementwise(out, ref_out)
        assert_close_elementwise(new_residual, ref_residual)
        if not with_residual:
            assert new_residual is x

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_apply_rotary_triton_matches_reference_on_a_split_qkv(self, dtype: torch.dtype) -> None:
        num_tokens, hq, hkv, head_dim = 7, 6, 2, 24
        gen = torch.Generator().manual_seed(2)
        qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
        q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
        k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(num_tokens, hkv, head_dim)
        cos, sin = rotary_cos_sin(head_dim, 128, 10000.0)
        positions = torch.randint(0, 128, (num_tokens,), generator=gen)
        q_out, k_out = apply_rotary_triton(q, k, positions, cos, sin)
        q_ref, k_ref = apply_rotary_ref(q, k, positions, cos, sin)
        assert_close_elementwise(q_out, q_ref)
        assert_close_elementwise(k_out, k_ref)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_rotary_store_kv_triton_writes_the_rotated_keys_and_values_to_their_slots(self, dtype) -> None:
        num_tokens, hq, hkv, head_dim = 5, 6, 2, 24
        gen = torch.Generator().manual_seed(6)
        qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
        q, k, v = qkv.split((hq * head_dim, hkv * head_dim, hkv * head_dim), dim=-1)
        q, k, v = q.view(num_tokens, hq, head_dim), k.view(num_tokens, hkv, head_dim), v.view(num_tokens, hkv, head_dim)
        cos, sin = rotary_cos_sin(head_dim, 64, 10000.0)
        positions = torch.randint(0, 64, (num_tokens,), generator=gen)
        slots = torch.randperm(30, generator=gen)[:num_tokens]
        caches = [torch.full((30, hkv, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
        q_out = rotary_store_kv_triton(q, k, v, positions, cos, sin, caches[0], caches[1], slots)
        q_ref = rotary_store_kv_ref(q, k, v, positions, cos, sin, caches[2], caches[3], slots)
        assert_close_elementwise(q_out, q_ref)
        written = torch.zeros(30, dtype=torch.bool)
        written[slots] = True
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.isnan(got[~written]).all()
            assert_close_elementwise(got[written], want[written])
        assert torch.equal(caches[1][slots], v)  # values are copied as they are

    def test_sampling_triton_draws_the_reference_tokens(self) -> None:
        # 700 tokens: the row loops over a partial last block. Rows mix every cut, none, ties
        # (a flat row), a one-token top-k, and rows with no distribution (NaN, all -inf, +inf).
        vocab = 700
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(12, vocab, generator=gen) * 3
        x[5] = 0.25
        x[9, 11] = float("nan")
        x[10] = float("-inf")
        x[11, 3] = float("inf")
        temperature = torch.tensor([0.8, 1.0, 0.5, 1.3, 1.0, 0.7, 1.0, 2.0, 0.9, 1.0, 1.0, 1.0])
        top_k = torch.tensor([vocab, 40, vocab, 7, vocab, 30, 1, vocab, 200, vocab, vocab, vocab])
        top_p = torch.tensor([0.95, 1.0, 0.5, 0.9, 1.0, 0.5, 1.0, 0.99, 0.8, 1.0, 1.0, 1.0])
        min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0])
        for trial in range(3):
            u = torch.rand(12, generator=gen)
            u[0] = 0.9999999  # the draw at the very top of the mass
            args = (x, temperature, top_k, top_p, min_p, u)
            out, ref = sample_filtered_triton(*args), sample_filtered_ref(*args)
            assert out.tolist() == ref.tolist(), trial
            # No distribution: the most likely token, NaN read as -inf (all -inf: the first).
            assert out[9:].tolist() == [x[9].nan_to_num(nan=float("-inf")).argmax().item(), 0, 3]
            assert (out[:9] >= 0).all() and (out[:9] < vocab).all()

    @pytest.mark.parametrize("vocab", [700, 2000])
    def test_sampling_triton_draws_uncut_rows_through_slices_at_the_exact_draw(self, vocab: int) -> None:
        # Temperature alone: slices of 256 (the last partial), a second launch picks the slice and
        # the token. Each token is where float64 sums put the row's target, give or take rounding.
        gen = torch.Generator().manual_seed(9)
        batch = 8
        x = torch.randn(batch, vocab, generator=gen) * 3
        x[1, : vocab // 2] = float("-inf")  # leading slices with no mass
        x[2] = torch.where(torch.rand(vocab, generator=gen) < 0.99, float("-inf"), x[2])  # a sparse row
        temperature = torch.tensor([0.8, 1.0, 0.5, 1.3, 2.0, 0.7, 1.0, 0.3])
        top_k, top_p, min_p = torch.full((batch,), vocab), torch.ones(batch), torch.zeros(batch)
        for trial in range(3):
            u = torch.rand(batch, generator=gen)
            u[0], u[3] = 0.9999999, 0.0
            out = sample_filtered_triton(x, temperature, top_k, top_p, min_p, u, slice_size=256)
            weights = filtered_weights_ref(x.double(), temperature.double(), top_k, top_p.double(), min_p.double())
            cdf = weights.cumsum(dim=-1)
            for row, token in enumerate(out.tolist()):
                target = u[row].item() * cdf[row, -1].item()
                below = cdf[row, token - 1].item() if token > 0 else 0.0
                assert weights[row, token] > 0, (trial, row)
                assert below <= target * (1 + 1e-5) and cdf[row, token].item() >= target * (1 - 1e-5), (trial, row)

    def test_sampling_triton_draws_a_row_alike_in_any_batch(self) -> None:
        # Cut and uncut rows side by side: each row's token is the one it draws alone.
        vocab = 900
        gen = torch.Generator().manual_seed(13)
        x = torch.randn(6, vocab, generator=gen) * 2
        temperature = torch.tensor([0.9, 0.9, 1.1, 0.6, 1.0, 0.8])
        top_k = torch.tensor([vocab, 50, vocab, vocab, vocab, 5])
        top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 1.0])
        min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
        u = torch.rand(6, generator=gen)
        together = sample_filtered_triton(x, temperature, top_k, top_p, min_p, u, slice_size=256)
        alone = [sample_filtered_triton(x[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1],
                                        min_p[r : r + 1], u[r : r + 1], slice_size=256).item() for r in range(6)]
        assert together.tolist() == alone
        ref = sample_filtered_ref(x, temperature, top_k, top_p, min_p, u)
        assert together[[1, 2, 3, 5]].tolist() == ref[[1, 2, 3, 5]].tolist()  # the cut rows: the filtered kernel

    @pytest.mark.parametrize("use_repetition, use_counts", [(True, True), (True, False), (False, True)])
    def test_penalties_triton_match_reference(self, use_repetition: bool, use_counts: bool) -> None:
        # 5000 tokens: two column blocks, the second partial; row 3 reads the empty table row 0.
        vocab, batch = 5000, 4
        gen = torch.Generator().manual_seed(8)
        x = torch.randn(batch, vocab, generator=gen) * 3
        counts = torch.randint(0, 4, (3, vocab), generator=gen, dtype=torch.int32)
        seen = torch.rand(3, vocab, generator=gen) < 0.3
        counts[0], seen[0] = 0, False
        index = torch.tensor([2, 1, 2, 0])
        settings = torch.tensor([[1.3, 0.5, 0.2], [0.8, 0.0, 1.0], [2.0, 1.5, 0.0], [1.0, 0.0, 0.0]])
        args = (index, counts, seen, settings[:, 0], settings[:, 1], settings[:, 2], use_repetition, use_counts)
        out, ref = x.clone(), x.clone()
        apply_penalties_triton(out, *args)
        apply_penalties_ref(ref, *args)
        assert torch.equal(out, ref)
        assert torch.equal(out[3], x[3]) and not torch.equal(out[0], x[0])

    def test_sampling_triton_hashes_the_uniforms_of_the_stream_keys(self) -> None:
        from pd_cluster.engine.sampler import random_bits, stream_key, uniform

        vocab, batch = 300, 6
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(batch, vocab, generator=gen) * 2
        keys = torch.tensor([[*stream_key(seed), pos] for seed, pos in
                             zip((0, 1, 2**40 + 3, 2**63 - 1, 77, 5), (0, 1, 2**31 + 5, 99, 2**20, 7))])
        # Settings as the sampler packs them: strided columns of one tensor each. Rows 1, 3 and 5
        # have no cut (top_p 1): drawn through the slices, with the same hashed uniforms.
        floats = torch.tensor([[0.9, 0.9, 0.0], [0.9, 1.0, 0.0]] * (batch // 2))
        ints = torch.cat((keys, torch.full((batch, 1), vocab)), dim=1)
        out = sample_filtered_triton(x, floats[:, 0], ints[:, 3], floats[:, 1], floats[:, 2],
                                     keys=(ints[:, 0], ints[:, 1], ints[:, 2]), slice_size=128)
        u = uniform(random_bits(keys[:, 0], keys[:, 1], keys[:, 2]))
        ref = sample_filtered_ref(x, floats[:, 0], ints[:, 3], floats[:, 1], floats[:, 2], u)
        assert out.tolist() == ref.tolist()

    # ---------------------------------------------------------------------------------------------
    # Few-row projections with the norm or the gate folded in
    # ---------------------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("num_rows", [1, 3, 4, 8])
    @pytest.mark.parametrize("with_residual", [False, True])
    def test_norm_linear_triton_matches_the_unfused_ops(self, dtype: torch.dtype, num_rows: int,
                                                        with_residual: bool) -> None:
        # 300 input features: two input blocks, the second partial; 37 outputs: a partial column block.
        gen = torch.Generator().manual_seed(11)
        x = (torch.randn(num_rows, 300, generator=gen) * 2).to(dtype)
        residual = torch.randn(num_rows, 300, generator=gen).to(dtype) if with_residual else None
        norm_weight = (torch.rand(300, generator=gen) + 0.5).to(dtype)
        weight = (torch.randn(37, 300, generator=gen) * 0.05).to(dtype)
        bias = torch.randn(37, generator=gen).to(dtype)
        out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, bias)
        ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, bias)
        assert_matches(out, ref, *GEMV_TOL[dtype])
        assert_close_elementwise(new_residual, ref_residual)

    def test_norm_linear_triton_writes_a_wider_output_rounded_as_the_unfused_op(self) -> None:
        # A float32 head output from bfloat16 weights: the bfloat16 product converted, not a float32 one.
        gen = torch.Generator().manual_seed(14)
        x, residual = torch.randn(2, 300, generator=gen).bfloat16(), torch.randn(2, 300, generator=gen).bfloat16()
        norm_weight = (torch.rand(300, generator=gen) + 0.5).bfloat16()
        weight = (torch.randn(70, 300, generator=gen) * 0.05).bfloat16()
        out, _ = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, out_dtype=torch.float32)
        ref, _ = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, out_dtype=torch.float32)
        assert out.dtype == ref.dtype == torch.float32
        assert torch.equal(out, out.bfloat16().float())  # every value a bfloat16 one
        assert_matches(out, ref, *GEMV_TOL[torch.bfloat16])

    def test_argmax_rows_triton_equals_torch(self) -> None:
        # Rows over several slices (the last partial), ties across and inside slices (the first
        # index wins), a NaN (it wins, as in torch), a row of -inf, one of a single slice.
        gen = torch.Generator().manual_seed(15)
        n = 2 * ARGMAX_SLICE + 37
        x = torch.randn(6, n, generator=gen)
        top = x.max() + 1
        x[1, [5, ARGMAX_SLICE + 3, n - 1]] = top          # tie across slices
        x[2, [ARGMAX_SLICE + 7, ARGMAX_SLICE + 9]] = top  # tie inside one slice
        x[3, 100], x[3, 200] = float("nan"), top
        x[4] = float("-inf")
        x[5, n - 1] = top                                 # in the partial last slice
        assert torch.equal(argmax_rows_triton(x), argmax_rows_ref(x))
        small = torch.randn(3, 100, generator=gen)
        assert torch.equal(argmax_rows_triton(small), argmax_rows_ref(small))
        assert argmax_rows_triton(torch.empty(0, 10)).shape == (0,)
        out = torch.full((4,), -5, dtype=torch.int64)
        assert argmax_rows_triton(small, out=out[:3]).data_ptr() == out.data_ptr()
        assert out[:3].tolist() == argmax_rows_ref(small).tolist() and out[3] == -5
        # Also stored to a row of host_out picked by a value read when the kernel runs; the other
        # rows and the row's columns past the ids are left alone.
        host_out = torch.full((3, 5), -7, dtype=torch.int64)
        argmax_rows_triton(small, out=out[:3], host_out=host_out, host_row=torch.tensor([2]))
        assert host_out[2].tolist() == argmax_rows_ref(small).tolist() + [-7, -7]
        assert (host_out[:2] == -7).all()
        with pytest.raises(ValueError, match="hold 2 ids"):
            argmax_rows_triton(small, host_out=host_out[:, :2], host_row=torch.tensor([0]))

    def test_choose_ids_triton_takes_argmax_or_draw_and_stores_the_host_row(self) -> None:
        # The greedy flags a strided column (as in the draw's settings table); the ids go to ``out``
        # and to the host row read when the kernel runs, the other host rows left alone.
        settings = torch.zeros(5, 3, dtype=torch.int64)
        settings[[0, 3], 2] = 1
        argmax = torch.tensor([11, 12, 13, 14, 15])
        drawn = torch.tensor([21, 22, 23, 24, 25])
        out = torch.full((6,), -5, dtype=torch.int64)
        host_out = torch.full((3, 7), -7, dtype=torch.int64)
        got = choose_ids_triton(settings[:, 2], argmax, drawn, out[:5], host_out, torch.tensor([1]))
        assert got.data_ptr() == out.data_ptr()
        assert out.tolist() == [11, 22, 23, 14, 25, -5]
        assert host_out[1].tolist() == [11, 22, 23, 14, 25, -7, -7]
        assert (host_out[[0, 2]] == -7).all()
        ref_out, ref_host = torch.empty(5, dtype=torch.int64), torch.full((3, 7), -7, dtype=torch.int64)
        choose_ids_ref(settings[:, 2], argmax, drawn, ref_out, ref_host, torch.tensor([1]))
        assert torch.equal(ref_out, out[:5]) and torch.equal(ref_host, host_out)
        # Written in place over the argmax (what a captured draw does), without a host row.
        in_place = argmax.clone()
        choose_ids_triton(settings[:, 2], in_place, drawn, in_place)
        assert in_place.tolist() == [11, 22, 23, 14, 25]
        with pytest.raises(ValueError, match="hold 4 ids"):
            choose_ids_triton(settings[:, 2], argmax, drawn, out[:5], host_out[:, :4], torch.tensor([0]))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_embed_step_inputs_triton_matches_reference(self, dtype: torch.dtype) -> None:
        # Ids on the host and ids left on the device (-row - 1), slots entering the request table,
        # padding tokens (the pad slot) writing nothing there.
        gen = torch.Generator().manual_seed(16)
        embed = torch.randn(50, 40, generator=gen).to(dtype)
        prev = torch.tensor([7, 31, 2, 44, 0], dtype=torch.int64)
        pad_slot = 99
        ids = torch.tensor([3, -2, 17, -5, 0, 0])
        positions = torch.tensor([4, 9, 0, 1, 0, 0])
        slots = torch.tensor([12, 40, 41, 13, pad_slot, pad_slot])
        rows = torch.tensor([1, 0, 2, 2, 0, 0])
        outs = []
        for fn in (embed_step_inputs_triton, embed_step_inputs_ref):
            table = torch.full((3, 10), -1, dtype=torch.int64)
            step_ids = ids.clone()
            outs.append((fn(step_ids, prev, positions, slots, rows, table, pad_slot, embed), step_ids, table))
        (got, got_ids, got_table), (want, want_ids, want_table) = outs
        assert torch.equal(got, want) and got.dtype == dtype
        assert got_ids.tolist() == want_ids.tolist() == [3, 31, 17, 0, 0, 0]
        assert torch.equal(got_table, want_table)
        assert (got_table != -1).sum() == 4 and got_table[0, 0] == -1  # the padding wrote nothing
        assert got_table[1, 4] == 12 and got_table[2, 1] == 13

    def test_norm_linear_triton_picks_the_rows_asked_for(self) -> None:
        gen = torch.Generator().manual_seed(12)
        x, residual = torch.randn(6, 40, generator=gen), torch.randn(6, 40, generator=gen)
        norm_weight, weight = torch.rand(40, generator=gen) + 0.5, torch.randn(50, 40, generator=gen)
        rows = torch.tensor([5, 0, 3])
        out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-6, weight, rows=rows)
        ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-6, weight, rows=rows)
        assert_matches(out, ref, *GEMV_TOL[torch.float32])
        assert_close_elementwise(new_residual, ref_residual)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_silu_linear_and_linear_triton_match_the_unfused_ops(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(13)
        gate_up = (torch.randn(2, 600, generator=gen) * 2).to(dtype)
        weight = (torch.randn(21, 300, generator=gen) * 0.05).to(dtype)
        assert_matches(silu_linear_triton(gate_up, weight), silu_linear_ref(gate_up, weight), *GEMV_TOL[dtype])
        # 5 rows of 300 inputs: blocks of 256; 4 rows: one tile of rows, as the SiLU's 2 rows above.
        x = torch.randn(5, 300, generator=gen).to(dtype)
        assert_matches(linear_triton(x, weight), linear_ref(x, weight), *GEMV_TOL[dtype])
        assert_matches(linear_triton(x[:4], weight), linear_ref(x[:4], weight), *GEMV_TOL[dtype])

    @pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_projections_read_8_bit_weights_and_scale_each_channel(self, dtype: torch.dtype,
                                                                   qdtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(15)
        limit = 127 if qdtype == torch.int8 else 448
        codes = lambda n, k: (torch.randn(n, k, generator=gen) * limit / 3).clamp(-limit, limit).to(qdtype)  # noqa: E731
        scale = lambda n: torch.rand(n, generator=gen) * 2e-3 + 1e-4  # outputs of a few units  # noqa: E731
        # One tile of rows (3 rows of 40), blocks of 256 (5 rows of 300), one long row (2400: in
        # float32 only, as the interpreter's bfloat16 truncations of its inputs add up over its length).
        for rows, k in ((3, 40), (5, 300)) + (((1, 2400),) if dtype == torch.float32 else ()):
            x, residual = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen).to(dtype)
            norm_weight, bias = (torch.rand(k, generator=gen) + 0.5).to(dtype), torch.randn(37, generator=gen).to(dtype)
            weight, w_scale = codes(37, k), scale(37)
            out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, bias, weight_scale=w_scale)
            ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, bias, weight_scale=w_scale)
            assert_matches(out, ref, *QUANT_GEMV_TOL[dtype])
            assert_close_elementwise(new_residual, ref_residual)
            assert_matches(linear_triton(x, weight, w_scale), linear_ref(x, weight, w_scale), *QUANT_GEMV_TOL[dtype])
        gate_up, down, d_scale = torch.randn(2, 600, generator=gen).to(dtype), codes(21, 300), scale(21)
        assert_matches(silu_linear_triton(gate_up, down, d_scale), silu_linear_ref(gate_up, down, d_scale),
                       *QUANT_GEMV_TOL[dtype])
        with pytest.raises(ValueError, match="scale"):
            linear_triton(x, weight)

    @pytest.mark.parametrize("tiles,stream,vec", [((1, 4, 128), False, 8), ((1, 4, 128), True, 8),
                                                  ((1, 4, 128), False, 16), ((1, 2, 512), False, 8),
                                                  ((1, 8, 64), True, 16)])
    def test_one_row_8_bit_projections_match_over_their_load_shapes(self, tiles: tuple[int, int, int], stream: bool,
                                                                    vec: int) -> None:
        """Each way a row's 8-bit codes can load (8 or 16 a thread; blocks carried or streamed; the
        row in one block or several) computes the same products, with each prologue."""
        gen = torch.Generator().manual_seed(46)
        k, n = 300, 37
        codes = lambda n, k: (  # noqa: E731
            (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn))
        scale = lambda n: torch.rand(n, generator=gen) * 2e-3 + 1e-4  # noqa: E731
        config = {"tiles": tiles, "num_warps": 4, "stream": stream, "vec": vec}
        x, residual = torch.randn(1, k, generator=gen), torch.randn(1, k, generator=gen)
        norm_weight = torch.rand(k, generator=gen) + 0.5
        weight, w_scale = codes(n, k), scale(n)
        out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, weight_scale=w_scale, **config)
        ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, weight_scale=w_scale)
        assert_matches(out, ref, *QUANT_GEMV_TOL[torch.float32])
        assert_close_elementwise(new_residual, ref_residual)
        assert_matches(linear_triton(x, weight, w_scale, **config), linear_ref(x, weight, w_scale),
                       *QUANT_GEMV_TOL[torch.float32])
        gate_up, down, d_scale = torch.randn(1, 2 * k, generator=gen), codes(n, k), scale(n)
        assert_matches(silu_linear_triton(gate_up, down, d_scale, **config), silu_linear_ref(gate_up, down, d_scale),
                       *QUANT_GEMV_TOL[torch.float32])

    @pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
    @pytest.mark.parametrize("tiles,stream", [((1, 4, 512), False), ((1, 4, 128), True), ((1, 2, 128), False)])
    def test_one_row_8_bit_products_in_float16_pairs(self, qdtype: torch.dtype, tiles: tuple[int, int, int],
                                                     stream: bool) -> None:
        """Products in float16 pairs (bfloat16 inputs: the row in one block, with the norm or not;
        blocks streamed or carried) match the reference as the float32 products do, over inputs
        of any magnitude (each run's scale: inputs of 1e5 and 1e-5 neither overflow float16 nor
        fall below its normal range)."""
        gen = torch.Generator().manual_seed(47)
        k, n = 300, 37
        limit = 127 if qdtype == torch.int8 else 448
        weight = (torch.randn(n, k, generator=gen) * limit / 3).clamp(-limit, limit).to(qdtype)
        w_scale = torch.rand(n, generator=gen) * 2e-3 + 1e-4
        config = {"tiles": tiles, "num_warps": 4, "stream": stream, "vec": 8, "f16": True}
        for magnitude in (1.0, 1e5, 1e-5):
            x, residual = (torch.randn(1, k, generator=gen) * magnitude).bfloat16(), torch.zeros(1, k).bfloat16()
            norm_weight = (torch.rand(k, generator=gen) * magnitude + 0.5).bfloat16()
            out, _ = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, weight_scale=w_scale, **config)
            ref, _ = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, weight_scale=w_scale)
            assert_matches(out, ref, QUANT_GEMV_TOL[torch.bfloat16][0], ref.abs().max().item() * 0.05)
            out = linear_triton(x, weight, w_scale, **config)
            ref = linear_ref(x, weight, w_scale)
            assert_matches(out, ref, QUANT_GEMV_TOL[torch.bfloat16][0], ref.abs().max().item() * 0.05)
            gate_up = (torch.randn(1, 2 * k, generator=gen) * magnitude).bfloat16()
            out, ref = silu_linear_triton(gate_up, weight, w_scale, **config), silu_linear_ref(gate_up, weight, w_scale)
            assert_matches(out, ref, QUANT_GEMV_TOL[torch.bfloat16][0], ref.abs().max().item() * 0.05)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_fp8_activation_quantization_matches_the_torch_one(self, dtype: torch.dtype) -> None:
        """Scales exact. Codes exact but where the interpreter's float8 conversion rounds
        otherwise than torch: where rounding carries into the next power of two it drops the carry
        and writes half the code (127.04 -> 64, not 128), and subnormals it truncates (one code
        off). The GPU's conversion rounds as torch does (``tests/gpu``: all codes equal)."""
        gen = torch.Generator().manual_seed(21)
        # One block (72 inputs), blocks of 128 over 300, a row of zeros; the default block (9000).
        for k, block in ((72, None), (300, 128), (9000, None)):
            x = (torch.randn(6, k, generator=gen) * 3).to(dtype)
            x[2] = 0
            q, scale = act_quant_fp8_triton(x, block=block)
            ref_q, ref_scale = act_quant_fp8_ref(x)
            assert torch.equal(scale, ref_scale)
            got, want = q.float(), ref_q.float()
            carry_dropped = (got * 2 == want) & (torch.frexp(want)[0].abs() == 0.5)
            codes_apart = (q.view(torch.int8).int() - ref_q.view(torch.int8).int()).abs()
            assert bool(((codes_apart <= 1) | carry_dropped).all())
            assert (codes_apart > 0).float().mean() < 0.1

    @pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_weight_only_gemm_matches_the_scaled_product(self, dtype: torch.dtype, qdtype: torch.dtype) -> None:
        """The reference rounds the unscaled product to the input's dtype before scaling it, the
        kernel rounds once: float16 outputs of a few units differ by an ulp or two (2e-3)."""
        gen = torch.Generator().manual_seed(22)
        limit = 127 if qdtype == torch.int8 else 448
        # 37 rows over tiles of 16 (a partial one), 70 outputs over tiles of 32, 200 inputs in
        # blocks of 64 (a partial one); then the default tiles.
        weight = (torch.randn(70, 200, generator=gen) * limit / 3).clamp(-limit, limit).to(qdtype)
        scale = torch.rand(70, generator=gen) * 2e-3 + 1e-4
        bias = torch.randn(70, generator=gen).to(dtype)
        for rows, config in ((37, GemmConfig(16, 32, 64)), (9, None)):
            x = torch.randn(rows, 200, generator=gen).to(dtype)
            out = weight_only_linear_triton(x, weight, scale, bias, config)
            assert_matches(out, linear_ref(x, weight, scale) + bias, *WEIGHT_ONLY_TOL[dtype])
        with pytest.raises(ValueError, match="scale"):
            weight_only_linear_triton(x, weight, scale.double())

    @pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
    def test_one_row_streams_8_bit_weights_over_long_inputs(self, qdtype: torch.dtype) -> None:
        """One row over more inputs than a tile reads whole: 8-bit weight blocks streamed (the next
        block's load before the current block's products, products summed across the tile once),
        with the norm, the SiLU gate and neither; default tiles (9000 inputs: blocks of 2048, the
        last partial) and small ones (1200 inputs in blocks of 512 over 3 channels a program)."""
        gen = torch.Generator().manual_seed(16)
        limit = 127 if qdtype == torch.int8 else 448
        codes = lambda n, k: (torch.randn(n, k, generator=gen) * limit / 3).clamp(-limit, limit).to(qdtype)  # noqa: E731
        for k, tiles in ((9000, None), (1200, (1, 4, 512))):
            weight, w_scale = codes(23, k), torch.rand(23, generator=gen) * 2e-4 + 1e-5
            x, residual = torch.randn(1, k, generator=gen), torch.randn(1, k, generator=gen)
            norm_weight = torch.rand(k, generator=gen) + 0.5
            assert_matches(linear_triton(x, weight, w_scale, tiles=tiles), linear_ref(x, weight, w_scale),
                           *QUANT_GEMV_TOL[torch.float32])
            out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight, weight_scale=w_scale)
            ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-5, weight, weight_scale=w_scale)
            assert_matches(out, ref, *QUANT_GEMV_TOL[torch.float32])
            assert_close_elementwise(new_residual, ref_residual)
            gate_up = torch.randn(1, 2 * k, generator=gen)
            assert_matches(silu_linear_triton(gate_up, weight, w_scale), silu_linear_ref(gate_up, weight, w_scale),
                           *QUANT_GEMV_TOL[torch.float32])

    def test_8_bit_weights_take_the_measured_tiles_before_the_heuristic(self, monkeypatch) -> None:
        assert quant_projection_config(1, 4096, 11008) == quant_projection_heuristic(1, 4096, 11008)
        assert quant_projection_config(1, 4096, 14336) == QUANT_TILES[(1, 4096, 14336)]
        monkeypatch.setitem(QUANT_TILES, (1, 23, 300), ((1, 8, 128), 4))
        assert quant_projection_config(1, 23, 300) == ((1, 8, 128), 4)
        gen = torch.Generator().manual_seed(17)
        weight = (torch.randn(23, 300, generator=gen) * 40).clamp(-127, 127).to(torch.int8)
        w_scale, x = torch.rand(23, generator=gen) * 1e-3 + 1e-4, torch.randn(1, 300, generator=gen)
        assert_matches(linear_triton(x, weight, w_scale), linear_ref(x, weight, w_scale), *QUANT_GEMV_TOL[torch.float32])

    def test_8_bit_entries_say_how_their_codes_load(self, monkeypatch) -> None:
        import kernels.gemv as gemv

        monkeypatch.setitem(QUANT_TILES, (1, 23, 300), ((1, 4, 64), 4, {"vec": 8, "stream": False, "f16": True}))
        assert quant_projection_config(1, 23, 300) == ((1, 4, 64), 4)
        assert quant_projection_loads(1, 23, 300) == {"vec": 8, "stream": False, "f16": True}
        assert quant_projection_loads(1, 4096, 11008) == {}
        seen: list[dict] = []
        real = gemv._gemv_kernel

        class Spy:
            def __getitem__(self, grid):
                return lambda *args, **kw: (seen.append(kw), real[grid](*args, **kw))[1]
        monkeypatch.setattr(gemv, "_gemv_kernel", Spy())
        gen = torch.Generator().manual_seed(18)
        weight = (torch.randn(23, 300, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_scale, x = torch.rand(23, generator=gen) * 1e-3 + 1e-4, torch.randn(1, 300, generator=gen)
        out = linear_triton(x.bfloat16(), weight, w_scale)
        assert_matches(out, linear_ref(x.bfloat16(), weight, w_scale), *QUANT_GEMV_TOL[torch.bfloat16])
        launch = seen[-1]
        assert (launch["BN"], launch["BK"], launch["VEC"], launch["F16_DOT"], launch["STREAM"]) == (4, 64, 8, True, False)
        # float32 inputs take no float16 products: not the entry's tiles either (measured with
        # them), the heuristic's
        out = linear_triton(x, weight, w_scale)
        assert_matches(out, linear_ref(x, weight, w_scale), *QUANT_GEMV_TOL[torch.float32])
        launch = seen[-1]
        (_, bn, bk), _ = quant_projection_heuristic(1, 23, 300)
        assert (launch["BN"], launch["BK"], launch["VEC"], launch["F16_DOT"]) == (bn, bk, 16, False)

    def test_one_row_over_long_inputs_goes_in_blocks(self) -> None:
        # One row of 2400 input features (above a whole-tile read): blocks of 1024, the third
        # partial, with the norm's sum taken over all of them first; and 9000 of them (the down
        # projection's long rows): sixteen columns a program.
        gen = torch.Generator().manual_seed(14)
        x, residual = torch.randn(1, 2400, generator=gen), torch.randn(1, 2400, generator=gen)
        norm_weight, weight = torch.rand(2400, generator=gen) + 0.5, torch.randn(19, 2400, generator=gen) * 0.02
        out, new_residual = norm_linear_triton(x, residual, norm_weight, 1e-5, weight)
        ref, ref_residual = norm_linear_ref(x, residual, norm_weight, 1e-5, weight)
        assert_matches(out, ref, *GEMV_TOL[torch.float32])
        assert_close_elementwise(new_residual, ref_residual)
        gate_up, down = torch.randn(1, 18000, generator=gen), torch.randn(21, 9000, generator=gen) * 0.01
        assert_matches(silu_linear_triton(gate_up, down), silu_linear_ref(gate_up, down), *GEMV_TOL[torch.float32])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(("num_rows", "head_dim", "with_bias"), [(1, 16, False), (3, 24, True), (1, 64, True)])
    def test_qkv_projection_with_rotary_and_kv_store_matches_the_unfused_ops(
        self, dtype: torch.dtype, num_rows: int, head_dim: int, with_bias: bool,
    ) -> None:
        # 3 q heads over 1 kv head (a group of 3); head_dim 24: pairs of 12, tiles cut to divide them.
        hq, hkv, hidden = 3, 1, 80
        gen = torch.Generator().manual_seed(15)
        x = (torch.randn(num_rows, hidden, generator=gen) * 2).to(dtype)
        residual = torch.randn(num_rows, hidden, generator=gen).to(dtype)
        norm_weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        weight = (torch.randn((hq + 2 * hkv) * head_dim, hidden, generator=gen) * 0.1).to(dtype)
        bias = torch.randn(weight.shape[0], generator=gen).to(dtype) if with_bias else None
        cos, sin = rotary_cos_sin(head_dim, 64, 10000.0)
        positions = torch.randint(0, 64, (num_rows,), generator=gen)
        slots = torch.randperm(20, generator=gen)[:num_rows]
        caches = [torch.full((20, hkv, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
        args = (x, residual, norm_weight, 1e-5, weight, bias, positions, cos, sin)
        q, new_residual = norm_qkv_rotary_triton(*args, caches[0], caches[1], slots, hq, hkv)
        q_ref, ref_residual = norm_qkv_rotary_ref(*args, caches[2], caches[3], slots, hq, hkv)
        assert q.shape == (num_rows, hq, head_dim)
        assert_matches(q, q_ref, *QKV_ROTARY_TOL[dtype])
        assert_close_elementwise(new_residual, ref_residual)
        written = torch.zeros(20, dtype=torch.bool)
        written[slots] = True
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.isnan(got[~written]).all()
            assert_matches(got[written], want[written], *QKV_ROTARY_TOL[dtype])

    def test_few_row_projections_refuse_more_rows_than_they_serve(self) -> None:
        x, weight = torch.randn(MAX_GEMV_ROWS + 1, 16), torch.randn(4, 16)
        with pytest.raises(ValueError, match="at most"):
            linear_triton(x, weight)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_silu_mul_triton_matches_reference(self, dtype: torch.dtype) -> None:
        # 1100 columns: two column blocks, the second partial.
        gate_up = (torch.randn(2, 3, 2200, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
        assert_close_elementwise(silu_mul_triton(gate_up), silu_mul_ref(gate_up))

    @pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
    def test_store_kv_triton_matches_reference(self, cache_dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(4)
        kv = torch.randn(6, 2 * 3 * 24, generator=gen)  # float32 in, cast into the cache's dtype
        k, v = kv[:, :72].view(6, 3, 24), kv[:, 72:].view(6, 3, 24)
        slots = torch.randperm(40, generator=gen)[:6]
        caches = [torch.full((40, 3, 24), float("nan"), dtype=cache_dtype) for _ in range(4)]
        store_kv_triton(k, v, caches[0], caches[1], slots)
        store_kv_ref(k, v, caches[2], caches[3], slots)
        written = torch.zeros(40, dtype=torch.bool)
        written[slots] = True
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.isnan(got[~written]).all()
            assert_close_elementwise(got[written], want[written])

    @pytest.mark.parametrize("kind", QUANT_KINDS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_store_kv_triton_quantizes_rows_into_the_reference_bytes(self, kind: str, dtype: torch.dtype) -> None:
        # head_dim 22: codes, two bytes of padding, then the scale. Rows of every magnitude, a zero
        # row (scale 1), and rows whose scale is exactly 1 (amax = the kind's largest code) holding
        # halfway values: both round them to even, as torch does. Asserted: the same bytes in
        # every slot, written or not (no exception for fp8 ties: the kernel rounds on the e4m3
        # grid in float32 before its cast).
        gen = torch.Generator().manual_seed(16)
        kv = (torch.randn(6, 2 * 3 * 22, generator=gen) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
        k, v = kv[:, :66].view(6, 3, 22), kv[:, 66:].view(6, 3, 22)
        k[0, 0] = 0.0
        ties = {"int8": [0.5, 1.5, 2.5, -2.5, -0.5, 126.5, 3.5], "fp8_e4m3": [17.0, 19.0, 9.5, 200.0, -17.0, 1.5 * 2**-9, -9.5]}
        k[1, 1] = 0.0
        k[1, 1, : len(ties[kind]) + 1] = torch.tensor([QUANT_MAX[kind], *ties[kind]]).to(dtype)
        v[2, 0, :8] = -torch.tensor([QUANT_MAX[kind], *ties[kind]]).to(dtype)
        slots = torch.randperm(40, generator=gen)[:6]
        caches = [torch.full((40, 3, row_bytes(22)), 255, dtype=torch.uint8) for _ in range(4)]
        store_kv_triton(k, v, caches[0], caches[1], slots, kind)
        store_kv_ref(k, v, caches[2], caches[3], slots, kind)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        assert (caches[0][slots[1], 1, 1:8] != 0).any()  # the ties were stored (not all rounded to zero)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_gather_and_scatter_kv_triton_match_reference(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(5)
        k_cache = torch.randn(3, 30, 5, 24, generator=gen).to(dtype)
        v_cache = torch.randn(3, 30, 5, 24, generator=gen).to(dtype)
        slots = torch.randperm(30, generator=gen)[:7]
        buffer = gather_kv_triton(k_cache, v_cache, slots)
        assert torch.equal(buffer, gather_kv_ref(k_cache, v_cache, slots))

        dst = [torch.randn(3, 12, 5, 24, generator=gen).to(dtype) for _ in range(2)]
        expected = [t.clone() for t in dst]
        dst_slots = torch.randperm(12, generator=gen)[:7]
        scatter_kv_triton(buffer, dst[0], dst[1], dst_slots)
        scatter_kv_ref(buffer, expected[0], expected[1], dst_slots)
        assert torch.equal(dst[0], expected[0]) and torch.equal(dst[1], expected[1])

    @pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "reference"])
    def test_gather_and_scatter_kv_move_quantized_rows_without_their_alignment_padding(self, triton_path: bool) -> None:
        # Stored rows of head_dim 22 are 32 bytes (values, scale at 24, padding from 28); a
        # handover moves 28 of them, and writing them back leaves the target's padding as it was.
        gen = torch.Generator().manual_seed(7)
        stored, moved = row_bytes(22), packed_row_bytes(22)
        assert (stored, moved) == (32, 28)
        src = [torch.randint(0, 256, (3, 30, 5, stored), generator=gen, dtype=torch.uint8) for _ in range(2)]
        slots = torch.randperm(30, generator=gen)[:7]
        gather, scatter = (gather_kv_triton, scatter_kv_triton) if triton_path else (gather_kv_ref, scatter_kv_ref)
        buffer = gather(src[0], src[1], slots, moved)
        assert buffer.shape == (2, 3, 7, 5, moved)
        assert torch.equal(buffer[0], src[0][:, slots, :, :moved]) and torch.equal(buffer[1], src[1][:, slots, :, :moved])
        dst = [torch.full((3, 12, 5, stored), 255, dtype=torch.uint8) for _ in range(2)]
        dst_slots = torch.randperm(12, generator=gen)[:7]
        scatter(buffer, dst[0], dst[1], dst_slots)
        for cache, part in zip(dst, buffer):
            assert torch.equal(cache[:, dst_slots, :, :moved], part)
            assert (cache[..., moved:] == 255).all()  # the padding is never written
        with pytest.raises(ValueError, match="do not fit"):
            gather(src[0], src[1], slots, stored + 4)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_copy_kv_slots_triton_matches_reference(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(6)
        src = [torch.randn(3, 30, 5, 24, generator=gen).to(dtype) for _ in range(2)]
        src_slots = torch.randperm(30, generator=gen)[:9]
        dst = [torch.randn(3, 16, 5, 24, generator=gen).to(dtype) for _ in range(2)]
        expected = [t.clone() for t in dst]
        dst_slots = torch.randperm(16, generator=gen)[:9]
        copy_kv_slots_triton(src[0], src[1], src_slots, dst[0], dst[1], dst_slots)
        copy_kv_slots_ref(src[0], src[1], src_slots, expected[0], expected[1], dst_slots)
        assert torch.equal(dst[0], expected[0]) and torch.equal(dst[1], expected[1])

    # ---------------------------------------------------------------------------------------------
    # Attention
    # ---------------------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_context_attention_triton_matches_reference_on_a_ragged_batch(self, dtype: torch.dtype) -> None:
        # Fresh prompt, cached prefixes, one new token, no new token; GQA group 3; small tiles so
        # every sequence spans several query and key tiles.
        batch = make_paged_batch(CTX_LENS, Q_LENS, 6, 2, 16, layout="shuffled", dtype=dtype, seed=6)
        out, ref = _context(batch, block_m=16, block_n=16)
        assert_matches(out, ref, *ATTENTION_TOL[dtype])

    def test_context_attention_triton_with_group_one_and_default_tiles(self) -> None:
        batch = make_paged_batch([70, 9, 33], [70, 4, 1], 4, 4, 24, layout="blocks16", seed=7)
        out, ref = _context(batch)
        assert_matches(out, ref, *ATTENTION_TOL[torch.float32])

    def test_context_attention_triton_reads_a_prefix_shared_through_slot_tables(self) -> None:
        batch = make_paged_batch([40, 11, 45], [8, 11, 13], 8, 2, 16, layout="blocks16", shared=(0, 2, 32),
                                 dtype=torch.float16, seed=8)  # fmt: skip
        out, ref = _context(batch, block_m=32, block_n=16)
        assert_matches(out, ref, *ATTENTION_TOL[torch.float16])

    @pytest.mark.parametrize("num_splits", [2, 4, 8])
    def test_context_attention_split_over_the_keys_matches_the_reference(self, num_splits: int) -> None:
        # Short chunks after long cached prefixes (a later turn), a fresh prompt, one new token and
        # none: splits from several key tiles each to empty ones (a tile's keys end before them).
        batch = make_paged_batch([150, 37, 97, 9, 20], [6, 37, 1, 9, 0], 6, 2, 16, layout="shuffled",
                                 dtype=torch.float16, seed=13)
        out, ref = _context(batch, block_m=16, block_n=16, num_splits=num_splits)
        assert_matches(out, ref, *ATTENTION_TOL[torch.float16])
        single, _ = _context(batch, block_m=16, block_n=16, num_splits=1)
        assert not torch.equal(out, single) or num_splits == 1  # the split path ran (other sums' order)

    def test_context_attention_split_leaves_rows_outside_sequences_unwritten(self) -> None:
        # In a mixed step the context kernel writes into the rows after the decode rows of one
        # output; the merge writes only its sequences' rows.
        batch = make_paged_batch([64, 23], [5, 3], 4, 2, 16, layout="blocks1", seed=14)
        q = torch.cat([batch.q, torch.randn(4, *batch.q.shape[1:])])
        out = torch.full_like(q, 7.0)
        args = (batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.3)
        context_attention_triton(q, *args, block_m=16, block_n=16, num_splits=4, out=out)
        assert torch.equal(out[batch.q.shape[0]:], torch.full_like(out[batch.q.shape[0]:], 7.0))
        assert_matches(out[: batch.q.shape[0]], context_attention_ref(batch.q, *args), *ATTENTION_TOL[torch.float32])
        with pytest.raises(ValueError, match="power of two"):
            context_attention_triton(q, *args, num_splits=3)

    def test_context_attention_triton_takes_a_strided_query_view(self) -> None:
        batch = make_paged_batch([19, 6], [11, 6], 4, 1, 16, layout="blocks1", seed=9)
        wide = torch.randn(batch.q.shape[0], 4 * 16 + 32)
        q = wide[:, : 4 * 16].view(-1, 4, 16)
        out, ref = _context(batch, q=q, block_m=16, block_n=16)
        assert_matches(out, ref, *ATTENTION_TOL[torch.float32])

    @pytest.mark.parametrize(
        ("dtype", "heads", "num_splits"),
        [
            (torch.float32, (6, 2), None),
            (torch.float32, (8, 2), 3),
            (torch.float16, (4, 4), 1),
            (torch.float16, (4, 1), 5),
        ],
    )
    @pytest.mark.parametrize("prefetch", [True, False], ids=["first-tile-early", "all-after-wait"])
    def test_decode_attention_triton_matches_reference(
        self, dtype: torch.dtype, heads: tuple[int, int], num_splits: int | None, prefetch: bool,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Contexts from one token (most splits empty) to several tiles per split; the split kernel
        # reads its first tile before its wait (few sequence-heads) or all after it.
        import kernels.attention_decode

        monkeypatch.setattr(kernels.attention_decode, "PREFETCH_MAX_HEADS", 128 if prefetch else 0)
        batch = make_paged_batch([1, 33, 64, 17], [1] * 4, *heads, 16, layout="shuffled", dtype=dtype, seed=10)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=num_splits)
        assert_matches(out, decode_attention_ref(*args), *ATTENTION_TOL[dtype])

    @pytest.mark.parametrize(("kind", "dtype", "num_splits"), [("int8", torch.float32, 1), ("int8", torch.float16, 4),
                                                               ("fp8_e4m3", torch.float32, 4),
                                                               ("fp8_e4m3", torch.float16, 1)])
    def test_context_attention_triton_reads_quantized_kv_as_the_reference(self, kind: str, dtype: torch.dtype,
                                                                        num_splits: int) -> None:
        # Fresh prompt, cached prefixes, one new token, no new token (the CPU test's batch).
        batch = _quantized(make_paged_batch(CTX_LENS, Q_LENS, 6, 2, 16, layout="shuffled", dtype=dtype, seed=6),
                           kind)
        out, ref = _context(batch, quant=kind, block_m=16, block_n=16, num_splits=num_splits)
        assert_matches(out, ref, *ATTENTION_TOL[dtype])

    @pytest.mark.parametrize(("kind", "dtype", "values_float16"), [("int8", torch.float32, None),
                                                                   ("int8", torch.float16, None),
                                                                   ("int8", torch.float16, False),
                                                                   ("fp8_e4m3", torch.float16, None),
                                                                   ("fp8_e4m3", torch.float16, False)])
    @pytest.mark.parametrize("prefetch", [True, False], ids=["first-tile-early", "all-after-wait"])
    def test_decode_attention_triton_reads_quantized_kv_as_the_reference(
        self, kind: str, dtype: torch.dtype, values_float16: bool | None, prefetch: bool,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # As the engine calls it: the request table read in place through each sequence's row;
        # fp8 values converted to float16 as they load (the default) or met as codes by the product.
        import kernels.attention_decode

        monkeypatch.setattr(kernels.attention_decode, "PREFETCH_MAX_HEADS", 128 if prefetch else 0)
        batch = _quantized(make_paged_batch([1, 33, 64, 17], [1] * 4, 8, 2, 16, layout="shuffled", dtype=dtype,
                                            seed=10), kind)
        rows = torch.tensor([2, 0, 5, 3])
        table = torch.full((6, batch.slot_table.shape[1]), 10 * batch.k_cache.shape[0], dtype=torch.int64)
        table[rows] = batch.slot_table
        common = (batch.q, batch.k_cache, batch.v_cache)
        out = decode_attention_triton(*common, table, batch.ctx_lens, 0.25, block_n=16, num_splits=3,
                                      table_rows=rows, quant=kind, values_float16=values_float16)
        ref = decode_attention_ref(*common, batch.slot_table, batch.ctx_lens, 0.25, quant=kind)
        assert_matches(out, ref, *ATTENTION_TOL[dtype])

    @pytest.mark.parametrize(("kind", "dtype"), [(None, torch.float32), ("int8", torch.float32),
                                                 ("int8", torch.float16), ("fp8_e4m3", torch.float16)])
    def test_decode_attention_triton_reading_a_tile_ahead_matches_the_reference(
        self, kind: str | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Each program reads its next tile while computing one: contexts of one token (the loop's
        # first read is its last), a tile and a token past it, several tiles a split.
        import kernels.attention_decode

        monkeypatch.setattr(kernels.attention_decode, "PREFETCH_MAX_HEADS", 0)
        batch = make_paged_batch([1, 17, 64, 33], [1] * 4, 8, 2, 16, layout="shuffled", dtype=dtype, seed=12)
        if kind is not None:
            batch = _quantized(batch, kind)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=2, num_stages=1, quant=kind, ahead=True)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[dtype])

    @pytest.mark.parametrize("kind", [None, "int8", "fp8_e4m3"])
    def test_decode_attention_triton_reading_slots_a_tile_ahead_matches_the_reference(
        self, kind: str | None, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # The key loop reads each next tile's slots a tile ahead (Hopper's default for fp8 KV at
        # many pairs): a one-token context (the read past its end masked), a tile and a token past
        # it, several tiles a split, splits left empty.
        import kernels.attention_decode

        monkeypatch.setattr(kernels.attention_decode, "PREFETCH_MAX_HEADS", 0)
        monkeypatch.setattr(kernels.attention_decode, "_decode_slots_ahead", lambda quant, device: True)
        batch = make_paged_batch([1, 17, 64, 33, 5], [1] * 5, 6, 3, 16, layout="shuffled", dtype=torch.float16,
                                 seed=18)
        if kind is not None:
            batch = _quantized(batch, kind)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=3, quant=kind)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[torch.float16])

    @pytest.mark.parametrize("kind", [None, "fp8_e4m3"])
    @pytest.mark.parametrize("heads_together", [True, False], ids=["heads-first", "sequences-first"])
    def test_decode_attention_triton_in_either_grid_order_matches_the_reference(
        self, kind: str | None, heads_together: bool,
    ) -> None:
        # The split kernel's grid walks kv heads or sequences first: each program still finds its
        # own sequence, head and split.
        batch = make_paged_batch([1, 17, 64, 33, 5], [1] * 5, 6, 3, 16, layout="shuffled", dtype=torch.float16,
                                 seed=13)
        if kind is not None:
            batch = _quantized(batch, kind)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=2, quant=kind, heads_together=heads_together)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[torch.float16])

    @pytest.mark.parametrize("kind", [None, "fp8_e4m3"])
    @pytest.mark.parametrize("num_splits", [1, 3, 16], ids=["one-split", "merged-to-codes", "too-wide-to-merge"])
    def test_decode_attention_codes_are_the_quantized_output(self, kind: str | None, num_splits: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
        # The merge writing an FP8 projection's codes (one program a sequence, all 6 q heads, a
        # one-token context's empty splits) gives act_quant_fp8 of the output, bit for bit; one
        # split, and more splits than a program holds (here 8 heads x 4 splits of 16), quantize
        # the output after.
        import kernels.attention_decode

        monkeypatch.setattr(kernels.attention_decode, "MERGE_CODES_MAX_VALUES", 8 * 4 * 16)
        batch = make_paged_batch([1, 17, 64, 33, 5], [1] * 5, 6, 2, 16, layout="shuffled", dtype=torch.float16,
                                 seed=15)
        if kind is not None:
            batch = _quantized(batch, kind)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        codes, scale = decode_attention_codes_triton(*args, quant=kind, num_splits=num_splits)
        out = decode_attention_triton(*args, num_splits=num_splits, quant=kind)
        want_codes, want_scale = act_quant_fp8_triton(out.reshape(5, -1))
        assert kernels.attention_decode._merge_codes_fits(6, num_splits, 16) == (num_splits < 16)
        assert torch.equal(scale, want_scale)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[torch.float16])

    @pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
    @pytest.mark.parametrize("prefetch", [True, False], ids=["first-tile-early", "all-after-wait"])
    @pytest.mark.parametrize("in_shift", [True, False], ids=["scales-in-scores", "scales-tile-max"])
    def test_decode_attention_triton_with_value_scales_in_the_scores_matches_the_reference(
        self, kind: str, prefetch: bool, in_shift: bool, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Value scales entered as logs into the scores (the weights carry them); values spanning
        # 1e-3..1e3 from token to token, so a scale applied twice or not at all shows.
        import kernels.attention_decode

        monkeypatch.setattr(kernels.attention_decode, "PREFETCH_MAX_HEADS", 128 if prefetch else 0)
        batch = make_paged_batch([1, 17, 64, 33], [1] * 4, 8, 2, 16, layout="shuffled", dtype=torch.float16,
                                 seed=14)
        spread = torch.logspace(-3, 3, batch.v_cache.shape[0], dtype=torch.float32)
        batch.v_cache.copy_((batch.v_cache.float() * spread[torch.randperm(spread.numel())].view(-1, 1, 1)).half())
        batch = _quantized(batch, kind)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=3, quant=kind, float16_codes=True,
                                      values_in_shift=in_shift)
        ref = decode_attention_ref(*args, quant=kind)
        rel, max_abs = ATTENTION_TOL[torch.float16]
        assert_matches(out, ref, rel, max_abs * float(ref.abs().max()))  # outputs up to ~1e3: float16's ulp

    def test_attention_triton_takes_bfloat16_q_as_float16_over_fp8_kv(self) -> None:
        # bfloat16 q meets e4m3 codes as float16 (a power of two a row): the kernels upcast q
        # before any product, so the interpreter computes this path as the GPU does; the output's
        # one bfloat16 truncation is the tolerance. q's heads span 1e-3..1e3, so a row's unit
        # that went wrong shows.
        batch = _quantized(make_paged_batch(CTX_LENS, Q_LENS, 6, 2, 16, layout="shuffled", seed=6), "fp8_e4m3")
        q = (batch.q * torch.logspace(-3, 3, 6).view(1, 6, 1)).to(torch.bfloat16)
        out, ref = _context(batch, q=q, quant="fp8_e4m3", block_m=16, block_n=16, num_splits=2)
        assert_matches(out, ref, *QUANT_BF16_TOL)
        decode = _quantized(make_paged_batch([1, 33, 64, 17], [1] * 4, 8, 2, 16, layout="shuffled", seed=10),
                            "fp8_e4m3")
        q = (decode.q * torch.logspace(-3, 3, 8).view(1, 8, 1)).to(torch.bfloat16)
        args = (q, decode.k_cache, decode.v_cache, decode.slot_table, decode.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=3, quant="fp8_e4m3", float16_codes=True)
        assert_matches(out, decode_attention_ref(*args, quant="fp8_e4m3"), *QUANT_BF16_TOL)

    def test_attention_triton_refuses_quantized_kv_in_a_float_cache(self) -> None:
        batch = make_paged_batch([9], [1], 4, 2, 16, seed=3)
        with pytest.raises(ValueError, match="uint8"):
            decode_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25,
                                    quant="int8")

    @pytest.mark.parametrize("decode", [True, False], ids=["decode", "context"])
    def test_attention_triton_refuses_quantized_rows_not_16_byte_aligned(self, decode: bool) -> None:
        # The kernels address rows in 16-byte units: rows without their alignment padding (a
        # handover's 20 bytes for head_dim 16) would be read at the wrong places, so they raise.
        batch = _quantized(make_paged_batch([9], [1], 4, 2, 16, seed=3), "int8")
        k, v = (c[..., : packed_row_bytes(16)].contiguous() for c in (batch.k_cache, batch.v_cache))
        with pytest.raises(ValueError, match="multiples of 16"):
            if decode:
                decode_attention_triton(batch.q, k, v, batch.slot_table, batch.ctx_lens, 0.25, quant="int8")
            else:
                context_attention_triton(batch.q, k, v, batch.slot_table, batch.ctx_lens, batch.q_lens,
                                         batch.q_start_loc, 0.25, quant="int8")

    @pytest.mark.parametrize("decode", [True, False], ids=["decode", "context"])
    def test_attention_reads_a_request_table_in_place_through_rows(self, decode: bool) -> None:
        # CUDA graphs pass the engine's request table and each sequence's row in it: the result
        # equals the same kernel over the rows copied out, whatever the other rows hold.
        q_lens = [1] * 3 if decode else [6, 40, 1]
        batch = make_paged_batch([9, 40, 23], q_lens, 4, 2, 16, layout="shuffled", seed=12)
        rows = torch.tensor([5, 0, 2])
        table = torch.randint(0, batch.k_cache.shape[0], (7, batch.slot_table.shape[1] + 3))
        table[rows, : batch.slot_table.shape[1]] = batch.slot_table
        common = (batch.k_cache, batch.v_cache)
        if decode:
            args = (batch.ctx_lens, 0.25)
            out = decode_attention_triton(batch.q, *common, table, *args, block_n=16, num_splits=3, table_rows=rows)
            want = decode_attention_triton(batch.q, *common, batch.slot_table, *args, block_n=16, num_splits=3)
        else:
            args = (batch.ctx_lens, batch.q_lens, batch.q_start_loc, 0.3)
            out = context_attention_triton(batch.q, *common, table, *args, block_m=16, block_n=16, table_rows=rows,
                                           num_splits=2)
            want = context_attention_triton(batch.q, *common, batch.slot_table, *args, block_m=16, block_n=16,
                                            num_splits=2)
        assert torch.equal(out, want)


if INTERPRETER:
    TestTritonKernelsInterpreted = InterpretedCases
else:

    def test_triton_kernels_match_references_in_the_interpreter() -> None:
        run_in_interpreter(__file__)
