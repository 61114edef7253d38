"""The qkv projection finished in one launch over float8 weights: the FP8 GEMM's rotary epilogue
(:mod:`kernels.qkv_epilogue`) against the unfused ops it replaces, run by Triton's interpreter.

The unfused ops here are the Triton kernels the model ran before (the projection, then
``rotary_store_kv``), interpreted too: the fused launch rounds where they do, so its output is
theirs bit for bit. The torch references agree within the interpreter's bfloat16 truncation.
As in ``test_kernels_triton.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_triton, rotary_epilogue_fits
from kernels.qkv_epilogue import QkvRotary
from kernels.quant_matmul import act_quant_fp8_ref
from kernels.rotary import apply_rotary_triton, rotary_cos_sin, rotary_store_kv_triton
from kernels.store_kv import store_kv_ref
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter

FP8 = torch.float8_e4m3fn
SLOTS = 80


def _caches(n: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.full((SLOTS, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(n)]


def _assert_same_kv(got: list[torch.Tensor], want: list[torch.Tensor], slots: torch.Tensor,
                    near: bool = False) -> None:
    """The same values at ``slots`` (``near``: as :func:`_assert_near`); every other slot left as
    it was (NaN)."""
    written = torch.zeros(SLOTS, dtype=torch.bool)
    written[slots] = True
    for g, w in zip(got, want):
        assert torch.isnan(g[~written]).all()
        if near:
            _assert_near(g[written], w[written])
        else:
            assert torch.equal(g[written], w[written])


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """The interpreter's dots (numpy's) may add a column's products in another order when the
    tile holds other columns (the epilogue's tiles hold rotary pairs): float32 outputs a few ulps
    apart, and the bfloat16 roundings of those nearly all equal."""
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    scale = want.abs().max().item()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
        assert (got == want).float().mean().item() >= 0.98


def _split(qkv: torch.Tensor, hq: int, hkv: int, head_dim: int):
    q, k, v = qkv.split((hq * head_dim, hkv * head_dim, hkv * head_dim), dim=-1)
    rows = qkv.shape[0]
    return q.reshape(rows, hq, head_dim), k.reshape(rows, hkv, head_dim), v.reshape(rows, hkv, head_dim)


_EPILOGUE_CONFIGS = [Fp8GemmConfig(16, 32, 64), Fp8GemmConfig(32, 64, 32, num_stages=2),
                     Fp8GemmConfig(16, 16, 32, split_k=2), Fp8GemmConfig(64, 32, 64, split_k=3)]
#: Every config at every row count, in each output dtype by turns (each config and each row count
#: meets both dtypes): the interpreter takes seconds a 64-row split case, and the dtype only
#: changes the epilogue's final cast.
_EPILOGUE_CASES = [(rows, config, (torch.float32, torch.bfloat16)[(i + j) % 2])
                   for i, config in enumerate(_EPILOGUE_CONFIGS) for j, rows in enumerate([1, 3, 16, 64])]


class InterpretedCases:
    @pytest.mark.parametrize("rows, config, dtype", _EPILOGUE_CASES)
    def test_fp8_gemm_rotary_epilogue_is_the_unfused_ops(self, rows: int, config: Fp8GemmConfig,
                                                         dtype: torch.dtype) -> None:
        """Whole tiles (32 and 64 columns: half a head and a head of 64) and split products (the
        parts' sum finishes a head at a time), a partial row tile; with a bias. With the caches, q
        and the KV slots are the plain GEMM's then the rotary kernel's (bit for bit but for the
        interpreter's dots, :func:`_assert_near`); without, the output is the plain one with q and
        k rotated (what a quantizing store then takes)."""
        hq, hkv, head_dim, k = 4, 2, 64, 160
        gen = torch.Generator().manual_seed(rows)
        xq, x_scale = act_quant_fp8_ref(torch.randn(rows, k, generator=gen))
        n = (hq + 2 * hkv) * head_dim
        weight = (torch.randn(n, k, generator=gen) * 150).clamp(-448, 448).to(FP8)
        w_scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
        bias = torch.randn(n, generator=gen).to(dtype)
        cos, sin = rotary_cos_sin(head_dim, 128, 10000.0)
        positions = torch.randint(0, 128, (rows,), generator=gen)
        slots = torch.randperm(SLOTS, generator=gen)[:rows]
        caches = _caches(4, hkv, head_dim, dtype)
        plain = fp8_gemm_triton(xq, x_scale, weight, w_scale, dtype, bias, config)
        q_plain, k_plain, v_plain = _split(plain, hq, hkv, head_dim)
        want_q = rotary_store_kv_triton(q_plain, k_plain, v_plain, positions, cos, sin, caches[2], caches[3], slots)
        rotary = QkvRotary(positions, cos, sin, hq, hkv, head_dim, caches[0], caches[1], slots)
        q = fp8_gemm_triton(xq, x_scale, weight, w_scale, dtype, bias, config, rotary)
        assert q.shape == (rows, hq * head_dim)
        _assert_near(q.view(rows, hq, head_dim), want_q)
        _assert_same_kv(caches[:2], caches[2:], slots, near=True)
        out = fp8_gemm_triton(xq, x_scale, weight, w_scale, dtype, bias, config,
                              QkvRotary(positions, cos, sin, hq, hkv, head_dim))
        q_rot, k_rot = apply_rotary_triton(q_plain, k_plain, positions, cos, sin)
        _assert_near(out, torch.cat([q_rot.flatten(1), k_rot.flatten(1), v_plain.flatten(1)], dim=1))

    @pytest.mark.parametrize("quant", ["int8", "fp8_e4m3"])
    def test_fp8_gemm_rotary_then_a_quantizing_store_is_the_unfused_ops(self, quant: str) -> None:
        """Into quantized caches the GEMM rotates k in its output and the quantizing store follows:
        the packed rows are those the rotation kernel's keys quantize to."""
        from kernels.kv_quant import packed_row_bytes, row_bytes

        hq, hkv, head_dim, k, rows = 2, 1, 32, 64, 16
        gen = torch.Generator().manual_seed(7)
        xq, x_scale = act_quant_fp8_ref(torch.randn(rows, k, generator=gen))
        n = (hq + 2 * hkv) * head_dim
        weight = (torch.randn(n, k, generator=gen) * 150).clamp(-448, 448).to(FP8)
        w_scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
        cos, sin = rotary_cos_sin(head_dim, 64, 10000.0)
        positions, slots = torch.randint(0, 64, (rows,), generator=gen), torch.randperm(SLOTS, generator=gen)[:rows]
        assert packed_row_bytes(head_dim) <= row_bytes(head_dim)
        caches = [torch.zeros((SLOTS, hkv, row_bytes(head_dim)), dtype=torch.uint8) for _ in range(4)]
        config = Fp8GemmConfig(16, 32, 32, split_k=2)  # the parts' sum rotates: the plain GEMM's sums
        out = fp8_gemm_triton(xq, x_scale, weight, w_scale, torch.float32, None, config,
                              QkvRotary(positions, cos, sin, hq, hkv, head_dim))
        _, k_rot, v_new = _split(out, hq, hkv, head_dim)
        store_kv_ref(k_rot, v_new, caches[0], caches[1], slots, quant)
        q_plain, k_plain, v_plain = _split(fp8_gemm_triton(xq, x_scale, weight, w_scale, torch.float32, None, config),
                                           hq, hkv, head_dim)
        _, k_want = apply_rotary_triton(q_plain, k_plain, positions, cos, sin)
        store_kv_ref(k_want, v_plain, caches[2], caches[3], slots, quant)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

    def test_fp8_gemm_refuses_tiles_that_split_a_rotary_pair(self) -> None:
        xq, x_scale = act_quant_fp8_ref(torch.randn(4, 64))
        weight, w_scale = torch.zeros(4 * 24, 64).to(FP8), torch.ones(4 * 24)
        cos, sin = rotary_cos_sin(24, 8, 10000.0)
        rotary = QkvRotary(torch.zeros(4, dtype=torch.long), cos, sin, 2, 1, 24)
        with pytest.raises(ValueError, match="rotary pair"):
            fp8_gemm_triton(xq, x_scale, weight, w_scale, torch.float32, None, Fp8GemmConfig(16, 32, 64), rotary)
        with pytest.raises(ValueError, match="heads"):
            fp8_gemm_triton(xq, x_scale, weight[:90], w_scale[:90], torch.float32, None, Fp8GemmConfig(16, 32, 64),
                            rotary)


def test_the_rotary_epilogue_takes_tiles_of_whole_pairs_or_split_products() -> None:
    """The 8B shape's qkv configs (tiles of 64 columns, heads of 128; 16 and 32 rows split four
    ways) all fit; a tile of 64 columns over heads of 24 does not unless the product splits."""
    for rows in (9, 16, 32, 64):
        assert rotary_epilogue_fits(rows, 6144, 4096, 128)
    assert not rotary_epilogue_fits(64, 96, 64, 24, Fp8GemmConfig(16, 64, 64))
    assert rotary_epilogue_fits(64, 96, 64, 24, Fp8GemmConfig(16, 64, 32, split_k=2))
    assert not rotary_epilogue_fits(64, 96, 64, 23, Fp8GemmConfig(16, 64, 32, split_k=2))


if INTERPRETER:
    TestQkvRotaryQuantInterpreted = InterpretedCases
else:

    def test_qkv_rotary_quant_kernels_match_the_unfused_ops_in_the_interpreter() -> None:
        run_in_interpreter(__file__, min_passed=20)
