"""A sweep of what an fp8-weight decode step runs beyond the plain projections: the fused
projections' 8-bit tiles at one row (the norm before qkv, gate/up and the vocabulary head, the
SiLU gate before down), the head in bf16 against fp8, and at 16 to 64 rows the FP8 GEMM
(:mod:`kernels.fp8_gemm`) over its tiles against ``torch._scaled_mm`` and cuBLAS bf16. A chain of a
whole step's projections (32 layers and the head, cold) compares bf16 with fp8 under a bf16 and
under a float8 head.

Timing as :mod:`pd_cluster.bench.gpu.fp8_sweep`'s: each path in a CUDA graph over weight copies
three times L2. The GEMM paths include the activations' quantization before them (a decode step
runs it before each product). Winners print as table entries: ``QUANT_FUSED_TILES``
(one row), ``FP8_GEMM_CONFIGS``; the JSON goes to ``$OUT/fp8_decode_sweep.json`` (``--json`` elsewhere).

    python -m pd_cluster.bench.gpu.fp8_decode_sweep [--part fused|chain|gemm|all] [--rows 16,32,64]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, next_pow2, set_pdl
from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton
from kernels.gemv import linear_triton, norm_linear_triton, quant_projection_config, quant_projection_loads
from kernels.gemv import silu_linear_triton
from kernels.quant_matmul import act_quant_fp8_triton, weight_only_linear_triton
from pd_cluster.bench.gpu.fp8_sweep import SHAPES, Timing, copies, graph_us, record
from pd_cluster.model.quant_linear import quantize

logger = logging.getLogger(__name__)

#: The vocabulary head of the 8B shape (out, in): the fused norm before it.
HEAD = ("head", 128256, 4096)
#: The prologue each shape's fused op runs (1 the norm, 2 the SiLU gate, 0 none).
PROLOGUE = {"qkv": 1, "gate_up": 1, "down": 2, "o": 0, "head": 1}
#: One-row tiles of the GEMV ((BN, BK), warps) the fused ops try beside the chosen ones, by whether
#: a row is 4096 inputs or longer (each streamed where BK is below the row).
FUSED_CANDIDATES = {
    True: [((8, 512), 4), ((16, 512), 4), ((4, 1024), 4), ((2, 4096), 4)],
    False: [((2, 2048), 4), ((16, 512), 4), ((8, 1024), 4)],
}
#: FP8 GEMM (BN, BK, warps, stages); BM is the rows' power of two (16 to 64), the split-K the
#: one that makes at least 128 programs, and none (and twice that split for 64 x 256 tiles).
GEMM_CANDIDATES = [(64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (128, 256, 8, 3), (32, 256, 4, 5),
                   (64, 256, 4, 3)]
GEMM_ROWS = [16, 32, 64]
#: The fused sweep's shapes, the most bytes first (should the run be cut short).
FUSED_ORDER = [SHAPES[3], SHAPES[1], HEAD, SHAPES[0], SHAPES[2]]


def fused_call(name: str, n: int, k: int, rows: int = 1):
    """A call of ``name``'s decode op at ``rows`` rows: ``fn(weight, scale, **config)``."""
    if PROLOGUE[name] == 2:
        gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
        return lambda w, s=None, **c: silu_linear_triton(gate_up, w, s, **c)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    if PROLOGUE[name] == 0:
        return lambda w, s=None, **c: linear_triton(x, w, s, **c)
    residual, norm_w = torch.randn_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)
    return lambda w, s=None, **c: norm_linear_triton(x, residual, norm_w, 1e-5, w, weight_scale=s, **c)


def sweep_fused(out: list[Timing], shape: tuple[str, int, int]) -> None:
    """One row: the bf16 fused op, the fp8 one as it is chosen now, then each candidate."""
    name, n, k = shape
    w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    fp8 = copies(quantize(w16, "fp8"))
    bf16 = copies(w16)
    del w16
    call = fused_call(name, n, k)
    record(out, shape, 1, "bf16 fused", "default", [lambda w=w: call(w) for w in bf16], 2)
    del bf16
    now, loads = quant_projection_config(1, n, k, PROLOGUE[name]), quant_projection_loads(1, n, k, PROLOGUE[name])
    record(out, shape, 1, "fp8 fused gemv", f"now {now[0]} w{now[1]} {loads}", [lambda q=q, t=now[0], nw=now[1]: call(
        q.qweight, q.scale, tiles=t, num_warps=nw, **loads) for q in fp8], 1)
    for (bn, bk), warps in FUSED_CANDIDATES[k <= 4096]:
        bk = min(bk, next_pow2(k))
        label = f"{(1, bn, bk)} w{warps}"
        record(out, shape, 1, "fp8 fused gemv", label, [lambda q=q, t=(1, bn, bk), nw=warps: call(
            q.qweight, q.scale, tiles=t, num_warps=nw) for q in fp8], 1)
    del fp8
    torch.cuda.empty_cache()


def gemm_configs(rows: int, n: int, k: int) -> list[Fp8GemmConfig]:
    bm = min(64, max(16, next_pow2(rows)))
    found = [fp8_gemm_config(rows, n, k)]
    for bn, bk, warps, stages in GEMM_CANDIDATES:
        tiles = cdiv(n, bn) * cdiv(rows, bm)
        split = 1
        while tiles * split < 128 and k // (2 * split) >= 1024:
            split *= 2
        more = (2 * split,) if (bn, bk) == (64, 256) and split > 1 and k // (2 * split) >= 1024 else ()
        for s in sorted({1, split, *more}):
            cfg = Fp8GemmConfig(bm, bn, bk, s, warps, stages)
            if cfg not in found:
                found.append(cfg)
    return found


def sweep_gemm(out: list[Timing], shape: tuple[str, int, int], rows_swept: list[int]) -> None:
    """At each rows: cuBLAS bf16, the scaled product and the FP8 GEMM configs (each after the
    activations' quantization)."""
    name, n, k = shape
    w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    fp8 = copies(quantize(w16, "fp8"))
    bf16 = copies(w16)
    del w16
    for rows in rows_swept:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        record(out, shape, rows, "bf16 F.linear", "cublas", [lambda w=w: F.linear(x, w) for w in bf16], 2)
        record(out, shape, rows, "act quant triton", "default", [lambda: act_quant_fp8_triton(x)], 0)
        if k > 8192:  # a long row in one block (read once) against the default's two passes
            for warps in (8, 16):
                record(out, shape, rows, "act quant triton", f"one block w{warps}", [
                    lambda w=warps: act_quant_fp8_triton(x, block=next_pow2(k), num_warps=w)], 0)

        def scaled(q):
            xq, s = act_quant_fp8_triton(x)
            return torch._scaled_mm(xq, q.qweight.t(), scale_a=s, scale_b=q.scale[None, :], out_dtype=torch.bfloat16)
        record(out, shape, rows, "scaled_mm+triton quant", "", [lambda q=q: scaled(q) for q in fp8], 1)

        def gemm(q, cfg):
            xq, s = act_quant_fp8_triton(x)
            return fp8_gemm_triton(xq, s, q.qweight, q.scale, torch.bfloat16, config=cfg)
        if rows <= 32:
            record(out, shape, rows, "fp8 weight-only", "default", [
                lambda q=q: weight_only_linear_triton(x, q.qweight, q.scale) for q in fp8], 1)
        for cfg in gemm_configs(rows, n, k):
            record(out, shape, rows, "fp8 gemm+triton quant", cfg.label(),
                   [lambda q=q, c=cfg: gemm(q, c) for q in fp8], 1)
        set_pdl(False)  # the default config without dependent launches (quantization and GEMM)
        try:
            record(out, shape, rows, "fp8 gemm no pdl", "default", [lambda q=q: gemm(q, None) for q in fp8], 1)
        finally:
            set_pdl(True)
    del fp8, bf16
    torch.cuda.empty_cache()


def chain_us(layers: list[dict], head: tuple, rows: int, **config) -> float:
    """One decode step's projections at ``rows`` rows in a CUDA graph: each layer's four fused ops
    (the attention's output stands in by the queries' columns of qkv), then the head with its norm."""
    k = layers[0]["o"][0].shape[1]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    res0, norm_w = torch.randn_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)

    def step():
        h, res = x, res0
        for w in layers:
            qkv, res = norm_linear_triton(h, res, norm_w, 1e-5, w["qkv"][0], weight_scale=w["qkv"][1], **config)
            o = linear_triton(qkv[:, :k].contiguous(), *w["o"], **config)
            gate_up, res = norm_linear_triton(o, res, norm_w, 1e-5, w["gate_up"][0], weight_scale=w["gate_up"][1],
                                              **config)
            h = silu_linear_triton(gate_up, *w["down"], **config)
        return norm_linear_triton(h, res, norm_w, 1e-5, head[0], weight_scale=head[1], out_dtype=torch.float32,
                                  **config)[0]
    return graph_us([step], rounds=3)


def sweep_chain(out: list[Timing], num_layers: int) -> None:
    """The whole step's projections (``num_layers`` layers, cold: every weight read once a step):
    bf16, fp8 by the default kernels, fp8 with an fp8 head."""
    dims = {name: (n, k) for name, n, k in SHAPES}
    bf16_layers, fp8_layers = [], []
    for _ in range(num_layers):
        w16 = {name: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for name, (n, k) in dims.items()}
        bf16_layers.append({name: (w, None) for name, w in w16.items()})
        fp8_layers.append({name: tuple(quantize(w, "fp8").tensors()) for name, w in w16.items()})
    head16 = (torch.randn(HEAD[1], HEAD[2], device="cuda") * 0.02).to(torch.bfloat16)
    head8 = tuple(quantize(head16, "fp8").tensors())
    weight_bytes = sum(n * k for n, k in dims.values()) * num_layers
    head_elems = HEAD[1] * HEAD[2]
    cases = [("bf16", bf16_layers, (head16, None), {}, 2 * weight_bytes + 2 * head_elems),
             ("fp8, bf16 head", fp8_layers, (head16, None), {}, weight_bytes + 2 * head_elems),
             ("fp8, fp8 head", fp8_layers, head8, {}, weight_bytes + head_elems)]
    for label, layers, head, config, moved in cases:
        try:
            us = chain_us(layers, head, 1, **config)
        except Exception as exc:  # noqa: BLE001  # shown, not fatal
            logger.warning("chain %s failed: %s", label, str(exc)[:300])
            continue
        out.append(Timing("step", 1, f"chain {label}", f"{num_layers} layers", us, moved / us / 1e3, 0.0))
        print(f"step chain {label:24s} {us:9.1f} us {moved / us / 1e3:7.0f} GB/s", flush=True)


def best(timings: list[Timing]) -> list[dict]:
    """Per shape and rows, each path's best and its ratio to bf16's best."""
    rows_out = []
    for key in sorted({(t.shape, t.rows) for t in timings}):
        here = [t for t in timings if (t.shape, t.rows) == key]
        base = [t.us for t in here if "bf16" in t.path and "fp8" not in t.path]
        top: dict[str, Timing] = {}
        for t in here:
            if t.path not in top or t.us < top[t.path].us:
                top[t.path] = t
        for t in sorted(top.values(), key=lambda t: t.us):
            rows_out.append({"shape": t.shape, "rows": t.rows, "path": t.path, "config": t.config,
                             "us": round(t.us, 2), "vs_bf16": round(t.us / min(base), 3) if base else None,
                             "gb_per_s": round(t.gb_per_s)})
    return rows_out


def entries(table: list[dict]) -> list[str]:
    """The winners as source entries of ``QUANT_FUSED_TILES`` and ``FP8_GEMM_CONFIGS``."""
    dims = {name: (n, k) for name, n, k in SHAPES + [HEAD]}
    out = []
    for r in table:
        if r["shape"] not in dims:
            continue
        n, k = dims[r["shape"]]
        v = [int(d) for d in re.findall(r"\d+", r["config"])]
        note = f"  # {r['shape']} {r['us']} us, {r['vs_bf16']} of bf16"
        if r["path"] == "fp8 fused gemv" and PROLOGUE[r["shape"]]:
            out.append(f"QUANT_FUSED_TILES ({PROLOGUE[r['shape']]}, 1, {n}, {k}): "
                       f"(({v[0]}, {v[1]}, {v[2]}), {v[3]}),{note}")
        elif r["path"] == "fp8 gemm+triton quant":
            out.append(f"FP8_GEMM_CONFIGS ({next_pow2(r['rows'])}, {n}, {k}): "
                       f"Fp8GemmConfig({', '.join(map(str, v))}),{note}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("fused", "chain", "gemm", "all"), default="all")
    parser.add_argument("--layers", type=int, default=32, help="the chain's layers")
    parser.add_argument("--rows", default=",".join(map(str, GEMM_ROWS)), help="the GEMM's row counts")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--report", action="store_true", help="print the table of the (partial) --json only")
    args = parser.parse_args()
    if args.report:
        report([Timing(**t) for t in json.loads(args.json.read_text())["timings"]])
        return
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    path = args.json or (Path(os.environ["OUT"]) / f"fp8_decode_sweep_{args.part}.json" if os.environ.get("OUT")
                         else None)
    timings: list[Timing] = []
    rows = [int(r) for r in args.rows.split(",") if r]
    work = ([lambda s=s: sweep_fused(timings, s) for s in FUSED_ORDER] if args.part in ("fused", "all") else []) + \
        ([lambda: sweep_chain(timings, args.layers)] if args.part in ("chain", "all") else []) + \
        ([lambda s=s: sweep_gemm(timings, s, rows) for s in SHAPES] if args.part in ("gemm", "all") else [])
    for run in work:
        run()
        if path is not None:
            path.write_text(json.dumps({"partial": True, "timings": [asdict(t) for t in timings]}))
    table, winners = report(timings)
    if path is not None:
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "timing": "cuda graph, cold weights", "timings": [asdict(t) for t in timings],
                                    "best": table, "winners": winners}, indent=1))
        print(f"wrote {path}")


def report(timings: list[Timing]) -> tuple[list[dict], list[str]]:
    """Print each path's best per shape and rows, then the winners as table entries."""
    table = best(timings)
    print(f"\n{'shape':8s} {'rows':>4s} {'path':24s} {'config':30s} {'us':>8s} {'vs_bf16':>8s} {'GB/s':>6s}")
    for r in table:
        print(f"{r['shape']:8s} {r['rows']:4d} {r['path']:24s} {r['config']:30s} {r['us']:8.2f} "
              f"{r['vs_bf16'] or 0:8.3f} {r['gb_per_s']:6d}")
    winners = entries(table)
    print("\nwinners:\n    " + "\n    ".join(winners))
    return table, winners


if __name__ == "__main__":
    main()
