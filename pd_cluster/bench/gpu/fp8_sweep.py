"""A sweep of the 8-bit projection kernels over Llama-3-8B's shapes, to choose their tiles and the
row count where the weight-only GEMM hands over to the FP8 tensor cores.

For each projection (qkv 4096->6144, o 4096->4096, gate/up 4096->28672, down 14336->4096) and
rows 1, 16, 64, 128, 4096 it times bfloat16 ``F.linear`` (and the bf16 GEMV at one row), the
8-bit GEMV over a few tiles, ``torch._scaled_mm`` alone, after the torch activation quantization
and after the Triton one, and the weight-only GEMM over a few tile configs, with L2 flushed
between calls (an 8B step reads more weight than L2 holds). Each line gives the achieved GB/s
(every byte read and written once) and TFLOP/s; a table of the best of each path per shape and
rows comes last, and the JSON goes to ``$OUT/fp8_sweep.json`` where ``OUT`` is set.

    python -m pd_cluster.bench.gpu.fp8_sweep [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.gemv import linear_triton
from kernels.quant_matmul import GemmConfig, act_quant_fp8_ref, act_quant_fp8_triton, weight_only_linear_triton
from pd_cluster.model.quant_linear import QuantLinear, quantize

logger = logging.getLogger(__name__)

#: (name, out features, in features) of one Llama-3-8B layer's projections.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 16, 64, 128, 4096]
#: One-row GEMV tiles (BM, BN, BK) and warps for 8-bit weights.
GEMV_TILES = [((1, 1, 2048), 4), ((1, 2, 2048), 4), ((1, 4, 2048), 4), ((1, 8, 2048), 4), ((1, 2, 2048), 8),
              ((1, 2, 1024), 4)]
#: Weight-only GEMM (BN, BK, warps, stages); BM is the rows' power of two (16 to 128).
GEMM_TILES = [(32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 8, 4), (16, 256, 4, 4)]


@dataclass
class Timing:
    shape: str
    rows: int
    path: str
    config: str
    us: float
    gb_per_s: float
    tflops: float


def bench_us(fn: Callable[[], object]) -> float:
    import triton.testing  # a GPU-only dependency

    return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median")


def record(out: list[Timing], shape: tuple[str, int, int], rows: int, path: str, config: str,
           fn: Callable[[], object], weight_bytes: int) -> None:
    """Time ``fn`` and append its line (a config that fails to compile or run is logged, skipped)."""
    name, n, k = shape
    try:
        us = bench_us(fn)
    except Exception as exc:  # noqa: BLE001  # a config past the device's resources: shown, not fatal
        logger.warning("%s rows %d %s %s failed: %s", name, rows, path, config, exc)
        return
    moved = n * k * weight_bytes + 2 * rows * (n + k)
    t = Timing(name, rows, path, config, us, moved / us / 1e3, 2 * rows * n * k / us / 1e6)
    out.append(t)
    print(f"{name:8s} rows {rows:5d} {path:22s} {config:24s} {us:9.2f} us {t.gb_per_s:8.0f} GB/s "
          f"{t.tflops:7.1f} TFLOP/s", flush=True)


def sweep_shape(out: list[Timing], shape: tuple[str, int, int], rows: int, weights: dict[str, object],
                quick: bool) -> None:
    _, n, k = shape
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w16: torch.Tensor = weights["bf16"]  # type: ignore[assignment]
    fp8: QuantLinear = weights["fp8"]  # type: ignore[assignment]
    int8: QuantLinear = weights["int8"]  # type: ignore[assignment]
    record(out, shape, rows, "bf16 F.linear", "cublas", lambda: F.linear(x, w16), 2)
    if rows == 1:
        record(out, shape, rows, "bf16 gemv", "default", lambda: linear_triton(x, w16), 2)
        for tiles, warps in GEMV_TILES[:2] if quick else GEMV_TILES:
            for label, q in (("fp8", fp8), ("int8", int8)):
                record(out, shape, rows, f"{label} gemv", f"{tiles} w{warps}",
                       lambda q=q, t=tiles, w=warps: linear_triton(x, q.qweight, q.scale, tiles=t, num_warps=w), 1)
        record(out, shape, rows, "fp8 gemv", "default", lambda: linear_triton(x, fp8.qweight, fp8.scale), 1)
    wt, scale_b = fp8.qweight.t(), fp8.scale[None, :]
    xq, x_scale = act_quant_fp8_triton(x)
    record(out, shape, rows, "act quant torch", "", lambda: act_quant_fp8_ref(x), 0)
    record(out, shape, rows, "act quant triton", "default", lambda: act_quant_fp8_triton(x), 0)
    record(out, shape, rows, "scaled_mm alone", "", lambda: torch._scaled_mm(
        xq, wt, scale_a=x_scale, scale_b=scale_b, out_dtype=torch.bfloat16), 1)
    for label, quant in (("torch", act_quant_fp8_ref), ("triton", act_quant_fp8_triton)):
        def fp8_mm(quant: Callable = quant) -> torch.Tensor:
            q, s = quant(x)
            return torch._scaled_mm(q, wt, scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)
        record(out, shape, rows, f"scaled_mm+{label} quant", "", fp8_mm, 1)
    if 1 < rows <= 256:
        bm = max(16, 1 << (rows - 1).bit_length())
        for bn, bk, warps, stages in GEMM_TILES[:2] if quick else GEMM_TILES:
            cfg = GemmConfig(bm, bn, bk, warps, stages)
            for label, q in (("fp8", fp8), ("int8", int8)):
                record(out, shape, rows, f"{label} weight-only", f"{bn}x{bk} w{warps} s{stages}",
                       lambda q=q, c=cfg: weight_only_linear_triton(x, q.qweight, q.scale, config=c), 1)
        record(out, shape, rows, "fp8 weight-only", "default",
               lambda: weight_only_linear_triton(x, fp8.qweight, fp8.scale), 1)


def summary(timings: list[Timing]) -> list[dict]:
    """Per shape and rows: bf16's best, each path's best (with its config) and its ratio to bf16."""
    rows_out = []
    for name, _, _ in SHAPES:
        for rows in ROWS:
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


def layer_totals(table: list[dict]) -> dict[int, dict[str, float]]:
    """Per rows: each path's best times summed over the four projections (paths that ran on all
    four), the number that picks the weight-only GEMM's row limit."""
    out: dict[int, dict[str, float]] = {}
    for rows in ROWS:
        here = [r for r in table if r["rows"] == rows]
        sums = {p: sum(r["us"] for r in here if r["path"] == p) for p in {r["path"] for r in here}}
        out[rows] = {p: round(us, 1) for p, us in sums.items()
                     if sum(r["path"] == p for r in here) == len(SHAPES)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configs a kernel (a smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    timings: list[Timing] = []
    for shape in SHAPES:
        _, n, k = shape
        w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        weights = {"bf16": w16, "fp8": quantize(w16, "fp8"), "int8": quantize(w16, "int8")}
        for rows in ROWS:
            sweep_shape(timings, shape, rows, weights, args.quick)
        del weights, w16
        torch.cuda.empty_cache()
    table = summary(timings)
    print("\nbest of each path (vs_bf16: time over bf16's best at the same shape and rows)")
    print(f"{'shape':8s} {'rows':>5s} {'path':22s} {'config':24s} {'us':>9s} {'vs_bf16':>8s} {'GB/s':>6s} {'TFLOP/s':>8s}")
    for r in table:
        print(f"{r['shape']:8s} {r['rows']:5d} {r['path']:22s} {r['config']:24s} {r['us']:9.2f} {r['vs_bf16']:8.3f} "
              f"{r['gb_per_s']:6d} {r['tflops']:8.1f}")
    layer = layer_totals(table)
    print("\none layer's four projections, best config each (us): rows, then each path's sum")
    for rows, paths in layer.items():
        print(f"rows {rows:5d}: " + ", ".join(f"{p} {us:.1f}" for p, us in sorted(paths.items(), key=lambda i: i[1])))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "fp8_sweep.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "timings": [asdict(t) for t in timings], "best": table,
                                    "layer_us": {str(r): p for r, p in layer.items()}}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
