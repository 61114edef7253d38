"""A sweep of the 8-bit projection kernels over Llama-3-8B's shapes, to choose their tiles and the
row count where the weight-only GEMM hands over to the FP8 tensor cores.

For each projection (qkv 4096->6144, o 4096->4096, gate/up 4096->28672, down 14336->4096) and
rows 1 to 64 it times bfloat16 ``F.linear`` (and the bf16 GEMV up to its row limit), the 8-bit
GEMV over its candidate tiles (its default, the float tiles it had before, and those of
:data:`GEMV_CANDIDATES`), the fused projections of a decode layer (norm before qkv and gate/up, the
SiLU gate before down) in bf16 and fp8, ``torch._scaled_mm`` after the Triton activation
quantization, and the weight-only GEMM over a few tile configs.

Every path is timed as a decode step runs it: inside a CUDA graph (no launch overhead: a Python
launch of a many-argument Triton kernel costs more than the kernel), each call on its own copy of
the weight, the copies together three times what L2 holds, so that every call reads its weight
from memory. Each line gives the achieved GB/s (every byte read and written once); a table of the
best of each path per shape and rows comes last, then the winners as :data:`kernels.gemv.QUANT_TILES`
entries, and the layer's sums per rows (where the weight-only GEMM should hand over). The JSON
goes to ``$OUT/fp8_sweep.json`` where ``OUT`` is set (``--json`` elsewhere).

    python -m pd_cluster.bench.gpu.fp8_sweep [--quick] [--rows 1,2,4,8,16,32,64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels._triton import next_pow2
from kernels.gemv import (
    MAX_ROWS,
    linear_triton,
    norm_linear_triton,
    projection_tiles,
    quant_projection_config,
    silu_linear_triton,
)
from kernels.quant_matmul import GemmConfig, act_quant_fp8_triton, weight_only_config, weight_only_linear_triton
from pd_cluster.model.quant_linear import QuantLinear, quantize

logger = logging.getLogger(__name__)

#: (name, out features, in features) of one Llama-3-8B layer's projections; the two input widths
#: first (each compiles its own kernels), should the run be cut short.
SHAPES = [("qkv", 6144, 4096), ("down", 4096, 14336), ("o", 4096, 4096), ("gate_up", 28672, 4096)]
ROWS = [1, 2, 4, 8, 16, 32, 64]
#: 8-bit GEMV candidates ((BN, BK), warps) (BM: the rows' power of two), by whether a row fits a
#: 4096-input block: all at one row (longer rows stream their blocks), the first two at more (the
#: sweep's compiles are most of its time).
GEMV_CANDIDATES = {
    True: [((8, 512), 4), ((2, 4096), 8), ((8, 4096), 8), ((2, 4096), 4), ((4, 2048), 8), ((8, 1024), 4),
           ((4, 4096), 4)],
    False: [((4, 512), 4), ((16, 512), 4), ((2, 2048), 4), ((8, 1024), 4), ((4, 2048), 8), ((8, 256), 4)],
}
#: Weight-only GEMM (BN, BK, warps, stages) beside the default, from 16 rows; BM is
#: the rows' power of two (16 to 64).
GEMM_TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (16, 256, 4, 4), (64, 128, 8, 5)]
#: Bytes the weight copies of one path add up to: three times the H200's 50 MB of L2.
COLD_BYTES = 150 << 20
#: Calls a graph replays (over the copies in turn).
GRAPH_CALLS = 24


@dataclass
class Timing:
    shape: str
    rows: int
    path: str
    config: str
    us: float
    gb_per_s: float
    tflops: float


def graph_us(calls: list[Callable[[], object]], rounds: int = 5) -> float:
    """The median time of one call, the calls captured in turn (``GRAPH_CALLS`` in all) in one
    CUDA graph and replayed: the GPU's time without the host's launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles, and warms what a capture may not do (allocations)
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    n = max(1, GRAPH_CALLS // len(calls)) * len(calls)
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / n)
    del graph
    return statistics.median(times)


def record(out: list[Timing], shape: tuple[str, int, int], rows: int, path: str, config: str,
           calls: list[Callable[[], object]], weight_bytes: int) -> None:
    """Time ``calls`` and append its line (a config that fails to compile or run is logged, skipped)."""
    name, n, k = shape
    try:
        us = graph_us(calls)
    except Exception as exc:  # noqa: BLE001  # a config past the device's resources: shown, not fatal
        logger.warning("%s rows %d %s %s failed: %s", name, rows, path, config, str(exc)[:300])
        torch.cuda.synchronize()
        return
    moved = n * k * weight_bytes + 2 * rows * (n + k)
    t = Timing(name, rows, path, config, us, moved / us / 1e3, 2 * rows * n * k / us / 1e6)
    out.append(t)
    print(f"{name:8s} rows {rows:3d} {path:22s} {config:26s} {us:9.2f} us {t.gb_per_s:7.0f} GB/s", flush=True)


def copies(weight: torch.Tensor | QuantLinear) -> list:
    """Copies of ``weight`` that together exceed L2 a few times."""
    nbytes = weight.qweight.numel() if isinstance(weight, QuantLinear) else weight.numel() * weight.element_size()
    count = min(8, max(2, math.ceil(COLD_BYTES / nbytes)))
    if isinstance(weight, QuantLinear):
        return [QuantLinear(weight.qweight.clone(), weight.scale.clone()) for _ in range(count)]
    return [weight.clone() for _ in range(count)]


def gemv_candidates(rows: int, k: int, quick: bool) -> list[tuple[tuple[int, int, int], int]]:
    """The GEMV configs a sweep tries: the default, the float tiles, :data:`GEMV_CANDIDATES`."""
    bm = next_pow2(rows)
    found = [quant_projection_config(rows, 4096, k)]
    if rows > 1:  # (at one row the float tiles stream: "fp8 gemv before" times them as they were)
        found.append((projection_tiles(rows, 4096, k), 4))
    for (bn, bk), warps in GEMV_CANDIDATES[k <= 4096][: 2 if quick or rows > 1 else None]:
        if rows > 4 and bk > 1024:  # many rows over a long block: past the registers
            continue
        cfg = ((bm, bn, bk if k > 4096 or bk <= next_pow2(k) else next_pow2(k)), warps)
        if cfg not in found:
            found.append(cfg)
    return found


def sweep_gemv(out: list[Timing], shape: tuple[str, int, int], rows: int, x: torch.Tensor,
               weights: dict[str, list], quick: bool) -> None:
    """The GEMV paths at up to ``MAX_ROWS`` rows: plain over each candidate, then the fused op."""
    name, n, k = shape
    fp8, int8, w16 = weights["fp8"], weights["int8"], weights["bf16"]
    record(out, shape, rows, "bf16 gemv", "default", [lambda w=w: linear_triton(x, w) for w in w16], 2)
    for tiles, warps in gemv_candidates(rows, k, quick):
        label = f"{tiles} w{warps}"
        record(out, shape, rows, "fp8 gemv", label, [lambda q=q, t=tiles, nw=warps: linear_triton(
            x, q.qweight, q.scale, tiles=t, num_warps=nw) for q in fp8], 1)
    if rows == 1:  # the kernel before: float tiles, one row's blocks each summed before the next
        tiles = projection_tiles(rows, n, k)
        record(out, shape, rows, "fp8 gemv before", f"{tiles} w4", [lambda q=q: linear_triton(
            x, q.qweight, q.scale, tiles=tiles, stream=False) for q in fp8], 1)
    record(out, shape, rows, "int8 gemv", "default", [lambda q=q: linear_triton(x, q.qweight, q.scale)
                                                      for q in int8], 1)
    # The op the decode layer calls: the norm before qkv and gate/up, the SiLU gate before down.
    if name == "down":
        gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
        fused = lambda w, s=None: silu_linear_triton(gate_up, w, s)  # noqa: E731
    elif name == "o":
        fused = lambda w, s=None: linear_triton(x, w, s)  # noqa: E731
    else:
        residual, norm_w = torch.randn_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)
        fused = lambda w, s=None: norm_linear_triton(x, residual, norm_w, 1e-5, w, weight_scale=s)  # noqa: E731
    record(out, shape, rows, "bf16 fused", "default", [lambda w=w: fused(w) for w in w16], 2)
    record(out, shape, rows, "fp8 fused", "default", [lambda q=q: fused(q.qweight, q.scale) for q in fp8], 1)


def sweep_shape(out: list[Timing], shape: tuple[str, int, int], rows: int, weights: dict[str, list],
                quick: bool) -> None:
    _, n, k = shape
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    fp8, int8 = weights["fp8"], weights["int8"]
    record(out, shape, rows, "bf16 F.linear", "cublas", [lambda w=w: F.linear(x, w) for w in weights["bf16"]], 2)
    if rows <= MAX_ROWS:
        sweep_gemv(out, shape, rows, x, weights, quick)
    record(out, shape, rows, "act quant triton", "default", [lambda: act_quant_fp8_triton(x)], 0)

    def fp8_mm(q: QuantLinear) -> torch.Tensor:
        xq, s = act_quant_fp8_triton(x)
        return torch._scaled_mm(xq, q.qweight.t(), scale_a=s, scale_b=q.scale[None, :], out_dtype=torch.bfloat16)
    record(out, shape, rows, "scaled_mm+triton quant", "", [lambda q=q: fp8_mm(q) for q in fp8], 1)
    if rows > 1:
        bm = max(16, next_pow2(rows))
        default = weight_only_config(rows, n, k)
        tiles = [(default.block_n, default.block_k, default.num_warps, default.num_stages)]
        if rows >= 16:  # fewer rows share the 16-row tiles: the default alone
            tiles += [t for t in (GEMM_TILES[:2] if quick else GEMM_TILES) if t not in tiles]
        for bn, bk, warps, stages in tiles:
            cfg = GemmConfig(bm, bn, bk, warps, stages)
            record(out, shape, rows, "fp8 weight-only", f"{bn}x{bk} w{warps} s{stages}", [
                lambda q=q, c=cfg: weight_only_linear_triton(x, q.qweight, q.scale, config=c) for q in fp8], 1)
        record(out, shape, rows, "int8 weight-only", "default", [
            lambda q=q: weight_only_linear_triton(x, q.qweight, q.scale) for q in int8], 1)


def summary(timings: list[Timing], rows_swept: list[int]) -> list[dict]:
    """Per shape and rows: bf16's best, each path's best (with its config) and its ratio to bf16."""
    rows_out = []
    for name, _, _ in SHAPES:
        for rows in rows_swept:
            here = [t for t in timings if t.shape == name and t.rows == rows]
            if not here:
                continue
            bf16 = min(t.us for t in here if t.path.startswith("bf16"))
            best: dict[str, Timing] = {}
            for t in here:
                if t.path not in best or t.us < best[t.path].us:
                    best[t.path] = t
            for path, t in sorted(best.items(), key=lambda item: item[1].us):
                rows_out.append({"shape": name, "rows": rows, "path": path, "config": t.config, "us": round(t.us, 2),
                                 "vs_bf16": round(t.us / bf16, 3), "gb_per_s": round(t.gb_per_s),
                                 "tflops": round(t.tflops, 1)})
    return rows_out


def layer_totals(table: list[dict], rows_swept: list[int]) -> dict[int, dict[str, float]]:
    """Per rows: each path's best times summed over the four projections (paths that ran on all
    four), the number that picks the weight-only GEMM's row limit."""
    out: dict[int, dict[str, float]] = {}
    for rows in rows_swept:
        here = [r for r in table if r["rows"] == rows]
        sums = {p: sum(r["us"] for r in here if r["path"] == p) for p in {r["path"] for r in here}}
        out[rows] = {p: round(us, 1) for p, us in sums.items()
                     if sum(r["path"] == p for r in here) == len(SHAPES)}
    return out


def gemv_winners(table: list[dict]) -> dict[str, str]:
    """The fastest fp8 GEMV config per shape and rows, as ``QUANT_TILES`` entries (source text)."""
    dims = {name: (n, k) for name, n, k in SHAPES}
    out = {}
    for r in table:
        if r["path"] == "fp8 gemv":
            bm, bn, bk, warps = (int(v) for v in re.findall(r"\d+", r["config"]))
            n, k = dims[r["shape"]]
            out[f"{r['shape']} rows {r['rows']}"] = f"({bm}, {n}, {k}): (({bm}, {bn}, {bk}), {warps}),"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configs a kernel (a smoke run)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    parser.add_argument("--json", type=Path, default=None, help="where the JSON goes (default $OUT/fp8_sweep.json)")
    args = parser.parse_args()
    rows_swept = [int(r) for r in args.rows.split(",") if r]
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    timings: list[Timing] = []
    path = args.json or (Path(os.environ["OUT"]) / "fp8_sweep.json" if os.environ.get("OUT") else None)
    for shape in SHAPES:
        _, n, k = shape
        w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        weights = {"bf16": copies(w16), "fp8": copies(quantize(w16, "fp8")), "int8": copies(quantize(w16, "int8"))}
        for rows in rows_swept:
            sweep_shape(timings, shape, rows, weights, args.quick)
        del weights, w16
        torch.cuda.empty_cache()
        if path is not None:  # the shapes so far, should the run be cut short
            path.write_text(json.dumps({"partial": True, "timings": [asdict(t) for t in timings]}))
    table = summary(timings, rows_swept)
    print("\nbest of each path (vs_bf16: time over bf16's best at the same shape and rows)")
    print(f"{'shape':8s} {'rows':>4s} {'path':22s} {'config':26s} {'us':>9s} {'vs_bf16':>8s} {'GB/s':>6s}")
    for r in table:
        print(f"{r['shape']:8s} {r['rows']:4d} {r['path']:22s} {r['config']:26s} {r['us']:9.2f} {r['vs_bf16']:8.3f} "
              f"{r['gb_per_s']:6d}")
    layer = layer_totals(table, rows_swept)
    print("\none layer's four projections, best config each (us): rows, then each path's sum")
    for rows, paths in layer.items():
        print(f"rows {rows:3d}: " + ", ".join(f"{p} {us:.1f}" for p, us in sorted(paths.items(), key=lambda i: i[1])))
    winners = gemv_winners(table)
    print("\nfp8 GEMV winners as kernels.gemv.QUANT_TILES entries:")
    for where, entry in winners.items():
        print(f"    {entry:45s} # {where}")
    if path is not None:
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "timing": "cuda graph, cold weights", "timings": [asdict(t) for t in timings],
                                    "best": table, "layer_us": {str(r): p for r, p in layer.items()},
                                    "gemv_winners": winners}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
