"""The per-head RMSNorm (:mod:`kernels.head_norm`) over strided heads of a qkv projection, against
the row norm's reference; run by Triton's interpreter (in a child pytest unless
``TRITON_INTERPRET=1`` was set before Triton was imported)."""

from __future__ import annotations

import pytest
import torch

from kernels.head_norm import head_rms_norm, head_rms_norm_ref, head_rms_norm_triton
from kernels.rms_norm import rms_norm_ref
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _qkv_heads(tokens: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """The q and k heads as the model splits them: strided views of one projection's rows."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(tokens)) * 3
    q, k, _ = qkv.to(dtype).split((q_heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    return q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim)


def test_the_reference_is_the_row_norm_of_each_head() -> None:
    q, _ = _qkv_heads(5, 4, 2, 16, torch.float32)
    weight = torch.rand(16) + 0.5
    want, _ = rms_norm_ref(q.reshape(-1, 16), weight, 1e-6)
    got = head_rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    assert torch.equal(got.reshape(-1, 16), want)


class InterpretedCases:
    """Collected only where TRITON_INTERPRET=1 was set before Triton was imported."""

    @pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "dim", "dtype"), [
        (1, 4, 2, 64, torch.float32),  # one decode row
        (37, 8, 2, 128, torch.float16),  # rows not a multiple of a program's block
        (20, 3, 1, 72, torch.float32),  # head_dim not a power of two
        (130, 32, 4, 128, torch.float32),  # Qwen3's heads: 64 rows a program over 4160 query heads
    ])
    def test_strided_heads_match_the_reference(self, tokens, q_heads, kv_heads, dim, dtype) -> None:
        q, k = _qkv_heads(tokens, q_heads, kv_heads, dim, dtype)
        weight = (torch.rand(dim, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
        for heads in (q, k):
            got = head_rms_norm_triton(heads, weight, 1e-6)
            assert got.is_contiguous() and got.dtype == heads.dtype
            torch.testing.assert_close(got, head_rms_norm_ref(heads, weight, 1e-6), **TOL[dtype])

    def test_no_heads(self) -> None:
        q, _ = _qkv_heads(1, 4, 2, 16, torch.float32)
        assert head_rms_norm_triton(q[:0], torch.ones(16), 1e-6).shape == (0, 4, 16)


if INTERPRETER:
    TestHeadNormInterpreted = InterpretedCases
else:

    def test_head_norm_matches_the_reference_in_the_interpreter() -> None:
        run_in_interpreter(__file__, min_passed=6)
