"""The tiles of the few-row projections (:mod:`kernels.gemv`): for float weights as measured on an
H100, for 8-bit weights per shape as the sweep measures them, else from the bytes in flight an SM
a config keeps."""

from __future__ import annotations

from kernels._triton import next_pow2

#: Rows one launch serves; more rows are a GEMM's job (tensor cores, cuBLAS).
MAX_ROWS = 8
#: Rows (up to 2048 inputs) whose whole input row a program reads in one block.
ONE_BLOCK_ROWS = 4


def projection_tiles(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BM, BN, BK) as measured fastest on an H100. One row reads its whole weight tile (up to
    2048 inputs) in one block, before waiting on the kernel before it (a dependent launch): the
    default model's step replay 0.79 -> 0.56 ms; a few output columns a program there (more for a
    vocabulary head, whose programs each redo the norm). Longer rows (an 8B shape's 4096 and
    14336) go in blocks of 1024 over two to four columns a program, sixteen for the longest (the
    down projection): each of an 8B layer's projections then streams its weights faster than
    cuBLAS (qkv 20.7 against 23.0 us, gate/up 78.5 against 83.5, head 334 against 379). Up to
    :data:`ONE_BLOCK_ROWS` rows of up to 2048 inputs tile as one row does; more rows keep blocks of
    256, as their products need the registers. 8-bit weights take
    :func:`quant_projection_config` (with these tiles, blocks of 2048 inputs over half the columns
    made the fp8 8B decode step slower on an H200: 1.101 against 0.913 of bf16's)."""
    if rows == 1 and k > 2048:
        return 1, 16 if k > 8192 else 2 if n <= 8192 else 4, 1024
    if rows <= ONE_BLOCK_ROWS and k <= 2048:
        # The default model's head and down projection: 8 columns 22.9 and 1.97 us, against
        # 26.8 (16 columns) and 2.11 (4 columns); its gate/up (3072 x 576) 2.58 us with 4
        # columns against 2.74 with 8 (an H200). A few rows tile as one does: each program reads
        # its weight tile whole before its wait and multiplies it by every row.
        return next_pow2(rows), 8 if n > 8192 or k > 1024 else 4, next_pow2(k)
    bn = 16 if n > 16384 else 8 if n >= 2048 else 4
    return next_pow2(rows), bn, 128 if n > 16384 else 256


#: An 8-bit config: ((BM, BN, BK), warps), then how its codes load where not the launch's default
#: (``{"vec": 8, "f16": True}``: :func:`quant_projection_loads`).
QuantEntry = tuple[tuple[int, int, int], int] | tuple[tuple[int, int, int], int, dict[str, int | bool]]

#: 8-bit weights' GEMV configs ((BM, BN, BK), warps) by (rows' power of two, out features, in
#: features), as the sweep (``pd_cluster.bench.gpu.fp8_sweep``, which prints its winners as
#: entries) measures them fastest; a shape not here takes :func:`quant_projection_heuristic`.
QUANT_TILES: dict[tuple[int, int, int], QuantEntry] = {
    # One H200, the 8B shape's projections, each timed in a CUDA graph over cold weights
    # (``fp8-sweep-nvidia-h200-x1-2026-11-29-graphs.json``).
    (1, 6144, 4096): ((1, 8, 512), 4),  # qkv: 9.3 us against 12.5 with the tiles before
    (2, 6144, 4096): ((2, 2, 4096), 8),
    (4, 6144, 4096): ((4, 8, 512), 4),
    (8, 6144, 4096): ((8, 8, 512), 4),
    (1, 4096, 14336): ((1, 2, 2048), 4),  # down
    (2, 4096, 14336): ((2, 4, 512), 4),
    (4, 4096, 14336): ((4, 16, 512), 4),
    (8, 4096, 14336): ((8, 16, 512), 4),
    # o: blocks of 2048 carried (not streamed) over 8 channels and 8 warps, products in float16
    # pairs: 6.18 us against 7.79 with (1, 4, 1024) in float32 and 10.01 in bf16 (the one-row sweep
    # below, ``fp8-gemv-sweep-nvidia-h200-x1-2026-11-29-f16.json``)
    (1, 4096, 4096): ((1, 8, 2048), 8, {"stream": False, "vec": 8, "f16": True}),
    (2, 4096, 4096): ((2, 2, 4096), 8),
    (4, 4096, 4096): ((4, 2, 4096), 8),
    (8, 4096, 4096): ((8, 8, 512), 4),
    (1, 28672, 4096): ((1, 8, 512), 4),  # gate_up
    (2, 28672, 4096): ((2, 8, 512), 4),
    (4, 28672, 4096): ((4, 8, 512), 4),
    (8, 28672, 4096): ((8, 8, 512), 4),
}


def quant_projection_heuristic(rows: int, n: int, k: int) -> tuple[tuple[int, int, int], int]:
    """((BM, BN, BK), warps) for 8-bit weights, sized for memory parallelism: a decode projection
    reads every weight byte once, and what bounds it is the bytes in flight an SM (at the copy
    rate and a microsecond's latency, some 32 KiB or more), which the registers a program needs
    bound in turn (counts of the sm_90 builds by ``ptxas -v``; estimates, not yet timed on the
    GPU). One row of 2049-4096 inputs is read whole (one block: every load of the program's
    weight tile issued before its first wait, the norm in registers), four channels a program
    over eight warps: 16 KiB a program, 64 registers with the norm (4 programs an SM), 112
    without (2). Longer rows (14336) stream blocks of 512 codes over eight channels (``STREAM``:
    the next block's load issued before the current block's products): 80-96 registers, 5
    programs of two 4 KiB blocks an SM. Two to four rows over long inputs take blocks of 512 over
    eight channels (72-96 registers: 5-7 programs of 4 KiB). Inputs of up to 2048 (the default
    model) and more rows keep the float tiles, measured there."""
    if rows == 1 and 2048 < k <= 4096:
        return (1, 4, next_pow2(k)), 8
    if rows == 1 and k > 4096:
        return (1, 8, 512), 4
    if rows <= ONE_BLOCK_ROWS and k > 2048:
        return (next_pow2(rows), 8, 512), 4
    return projection_tiles(rows, n, k), 4


#: The fused projections' own 8-bit configs, by (prologue: 1 the norm, 2 the SiLU gate; rows' power
#: of two, out features, in features): a prologue changes what a program does between its weight
#: loads (the input re-read and normalised, or gated, every block), so its best tiles differ from
#: the plain projection's; a shape not here takes the plain one's.
QUANT_FUSED_TILES: dict[tuple[int, int, int, int], QuantEntry] = {
    # One H200, the 8B shape, in a CUDA graph over cold weights, by the one-row sweep
    # (``pd_cluster.bench.gpu.fp8_gemv_sweep``: ``fp8-gemv-sweep-nvidia-h200-x1-2026-11-29-f16.json``),
    # against the float32 products' best tiles and bf16's: 8 codes a thread (the input's layout),
    # products in float16 pairs (the codes carried as words: a quarter of float32's registers), so
    # a program holds 16 channels, over which its prologue (the norm: the input read, summed and
    # scaled; the SiLU gate) is shared. The float32 products' per-code cost was not what bounded
    # them: a plain GEMV of gate/up's tile read its codes at the copy rate either way (28.5 us
    # float32, 28.3 float16 pairs, 28.2 the bytes alone); what a wider program saves is its prologue.
    (1, 1, 6144, 4096): ((1, 16, 4096), 8, {"vec": 8, "f16": True}),  # norm + qkv: 9.39 us against 11.27, bf16 17.82
    (1, 1, 28672, 4096): ((1, 16, 4096), 8, {"vec": 8, "f16": True}),  # norm + gate_up: 33.21 against 40.01, bf16 58.07
    (2, 1, 4096, 14336): ((1, 16, 2048), 8, {"vec": 8, "f16": True}),  # SiLU + down: 17.81 against 26.50, bf16 34.20
}


def _quant_entry(rows: int, n: int, k: int, prologue: int) -> tuple:
    rows = next_pow2(rows)
    return (QUANT_FUSED_TILES.get((prologue, rows, n, k)) if prologue else None) or QUANT_TILES.get((rows, n, k)) \
        or quant_projection_heuristic(rows, n, k)


def quant_projection_config(rows: int, n: int, k: int, prologue: int = 0) -> tuple[tuple[int, int, int], int]:
    """((BM, BN, BK), warps) for 8-bit weights: the fused projection's entry
    (:data:`QUANT_FUSED_TILES`), the plain one's (:data:`QUANT_TILES`), else the heuristic."""
    entry = _quant_entry(rows, n, k, prologue)
    return entry[0], entry[1]


def quant_projection_loads(rows: int, n: int, k: int, prologue: int = 0) -> dict:
    """How the entry :func:`quant_projection_config` picks loads its codes (its third element:
    ``vec``, ``stream``, ``f16`` as :func:`kernels.gemv.linear_triton` takes them), or ``{}``:
    the launch's defaults."""
    entry = _quant_entry(rows, n, k, prologue)
    return dict(entry[2]) if len(entry) > 2 else {}
