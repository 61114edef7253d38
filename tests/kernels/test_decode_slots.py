"""Decode attention over a slot's kv heads in one access (:mod:`kernels.decode_slots`) against the
float reference, run by Triton's interpreter.

As in ``test_kernels_triton.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported:
with it set the interpreted cases are collected, else one test runs this file in a child pytest.
Unused slots hold NaN (16-bit caches) or 0xFF bytes (quantized: a NaN scale), and the slot
tables' padding points past the cache, so a read outside a sequence's slots shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import decode_attention_ref, decode_attention_triton
from kernels.decode_slots import decode_attention_slots, slots_head_block, slots_num_splits
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter
from tests.kernels.test_kernels import make_paged_batch
from tests.kernels.test_kernels_triton import ATTENTION_TOL, QUANT_BF16_TOL, _quantized, assert_matches

#: Contexts from one token (most splits empty) to several tiles a split.
CTX = [1, 33, 64, 17]


def _batch(kind: str | None, dtype: torch.dtype, heads: tuple[int, int], seed: int = 10, head_dim: int = 16):
    batch = make_paged_batch(CTX, [1] * len(CTX), *heads, head_dim, layout="shuffled", dtype=dtype, seed=seed)
    return batch if kind is None else _quantized(batch, kind)


class InterpretedCases:
    @pytest.mark.parametrize(("kind", "dtype", "heads", "block_h", "num_splits"), [
        (None, torch.float32, (8, 2), None, 3),
        (None, torch.float16, (8, 4), 2, 1),
        (None, torch.float16, (6, 3), None, 4),
        ("fp8_e4m3", torch.float16, (8, 2), None, 3),
        ("fp8_e4m3", torch.float16, (8, 4), 4, 2),
        ("fp8_e4m3", torch.float32, (8, 2), 1, 1),
        ("int8", torch.float16, (8, 4), 2, 3),
        ("int8", torch.float32, (6, 3), None, 2),
    ])
    @pytest.mark.parametrize("ahead", [False, True], ids=["tile-by-tile", "tile-ahead"])
    def test_decode_slots_matches_the_reference(self, kind: str | None, dtype: torch.dtype,
                                                heads: tuple[int, int], block_h: int | None,
                                                num_splits: int, ahead: bool) -> None:
        batch = _batch(kind, dtype, heads)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_slots(*args, block_n=16, block_h=block_h, num_splits=num_splits, quant=kind,
                                     ahead=ahead, num_stages=1 if ahead else 2)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[dtype])

    @pytest.mark.parametrize(("kind", "dtype"), [(None, torch.float32), ("fp8_e4m3", torch.float16),
                                                 ("int8", torch.float16)])
    def test_decode_slots_head_dim_short_of_a_power_of_two(self, kind: str | None, dtype: torch.dtype) -> None:
        # head_dim 12 in tiles of 16: the elements past a row (the scale, the next row, NaN in
        # unused slots) are never read into the products.
        batch = _batch(kind, dtype, (8, 2), head_dim=12)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_slots(*args, block_n=16, num_splits=2, quant=kind)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[dtype])

    @pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
    def test_decode_slots_takes_bfloat16_q_as_float16_over_quantized_kv(self, kind: str) -> None:
        # q's heads span 1e-3..1e3, so a row's unit that went wrong shows; the interpreter
        # truncates the output to bfloat16 (the tolerance).
        batch = _batch(kind, torch.float32, (8, 2))
        q = (batch.q * torch.logspace(-3, 3, 8).view(1, 8, 1)).to(torch.bfloat16)
        args = (q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_slots(*args, block_n=16, num_splits=3, quant=kind)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *QUANT_BF16_TOL)

    @pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
    def test_decode_slots_value_scales_spanning_decades(self, kind: str) -> None:
        # Values from 1e-3 to 1e3 token to token: a value scale applied twice or not at all shows.
        batch = make_paged_batch(CTX, [1] * len(CTX), 8, 2, 16, layout="shuffled", dtype=torch.float16, seed=14)
        spread = torch.logspace(-3, 3, batch.v_cache.shape[0], dtype=torch.float32)
        batch.v_cache.copy_((batch.v_cache.float() * spread[torch.randperm(spread.numel())].view(-1, 1, 1)).half())
        batch = _quantized(batch, kind)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_slots(*args, block_n=16, num_splits=3, quant=kind)
        ref = decode_attention_ref(*args, quant=kind)
        rel, max_abs = ATTENTION_TOL[torch.float16]
        assert_matches(out, ref, rel, max_abs * float(ref.abs().max()))

    def test_decode_slots_reads_a_request_table_through_rows_into_out(self) -> None:
        # As the engine calls it: the request table read in place, the result written into a
        # view of a wider buffer.
        batch = _batch("fp8_e4m3", torch.float16, (8, 2))
        rows = torch.tensor([2, 0, 5, 3])
        table = torch.full((6, batch.slot_table.shape[1] + 3), 10 * batch.k_cache.shape[0], dtype=torch.int64)
        table[rows, : batch.slot_table.shape[1]] = batch.slot_table
        wide = torch.full((4, 8, 16 + 8), float("nan"), dtype=torch.float16)
        out = decode_attention_slots(batch.q, batch.k_cache, batch.v_cache, table, batch.ctx_lens, 0.25,
                                     block_n=16, num_splits=2, table_rows=rows, quant="fp8_e4m3",
                                     out=wide[..., :16])
        ref = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25,
                                   quant="fp8_e4m3")
        assert_matches(out, ref, *ATTENTION_TOL[torch.float16])
        assert torch.isnan(wide[..., 16:]).all()

    @pytest.mark.parametrize(("kind", "dtype", "heads"), [(None, torch.float32, (8, 2)), (None, torch.float16, (6, 3)),
                                                          ("fp8_e4m3", torch.float16, (8, 2))])
    @pytest.mark.parametrize("late_release", [False, True])
    def test_per_head_kernel_merged_a_kv_head_a_program(self, kind: str | None, dtype: torch.dtype,
                                                         heads: tuple[int, int], late_release: bool) -> None:
        # The per-head kernel's splits merged by the slot-run kernel's merge (a program per
        # sequence and kv head), its dependents released after the key loop.
        batch = _batch(kind, dtype, heads)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        out = decode_attention_triton(*args, block_n=16, num_splits=3, quant=kind, merge_heads=True,
                                      late_release=late_release)
        assert_matches(out, decode_attention_ref(*args, quant=kind), *ATTENTION_TOL[dtype])

    def test_decode_slots_refuses_what_it_cannot_read(self) -> None:
        batch = _batch(None, torch.float16, (8, 4))
        args = (batch.q, batch.k_cache, batch.v_cache, batch.slot_table, batch.ctx_lens, 0.25)
        with pytest.raises(ValueError, match="block_h"):
            decode_attention_slots(*args, block_h=8)
        with pytest.raises(ValueError, match="uint8"):
            decode_attention_slots(*args, quant="int8")


def test_slots_launch_choices() -> None:
    # The largest power of two dividing the kv heads, at most 8; splits fill ~2 programs an SM
    # (4 on a CPU) and never leave a split shorter than a tile.
    assert [slots_head_block(n) for n in (8, 4, 3, 6, 16, 1)] == [8, 4, 1, 2, 8, 1]
    cpu = torch.device("cpu")
    assert slots_num_splits(1, 1, 4096, 16, cpu) == 8
    assert slots_num_splits(64, 1, 4096, 16, cpu) == 1
    assert slots_num_splits(1, 1, 20, 16, cpu) == 2


if INTERPRETER:
    TestDecodeSlotsInterpreted = InterpretedCases
else:

    def test_decode_slots_matches_references_in_the_interpreter() -> None:
        run_in_interpreter(__file__, min_passed=31)
