"""A sweep of the FP8 GEMM (:mod:`kernels.fp8_gemm`) at a decode batch's rows over the 8B shape's
four projections: its configs as chosen now, the same by tensor descriptor, and other tiles and
splits by descriptor, beside ``torch._scaled_mm`` and cuBLAS bf16; then a layer's four products in
turn in one graph, the chosen configs against this run's fastest.

Timing as :mod:`pd_cluster.bench.gpu.fp8_sweep`'s: CUDA graphs over weight copies three times L2,
each product after its activations' quantization. The narrowest shape first (it has the most to
gain), results printed as they come; the JSON goes to ``$OUT/fp8_gemm_sweep.json`` (``--json``
elsewhere), the winners print as ``FP8_GEMM_CONFIGS`` entries.

    python -m pd_cluster.bench.gpu.fp8_gemm_sweep [--rows 64] [--shapes down,qkv,o,gate_up]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels._triton import next_pow2
from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton
from kernels.quant_matmul import act_quant_fp8_triton
from pd_cluster.bench.gpu.fp8_sweep import SHAPES, Timing, copies, graph_us, record
from pd_cluster.model.quant_linear import quantize

logger = logging.getLogger(__name__)

#: The order of the shapes: the narrow outputs first.
ORDER = ["down", "o", "qkv", "gate_up"]
PATH = "fp8 gemm+triton quant"


def candidates(rows: int, n: int, k: int, quick: bool = False) -> list[Fp8GemmConfig]:
    """The chosen config by pointer loads and by tensor descriptor (``quick``: those alone), then
    other tiles and splits by descriptor."""
    now = replace(fp8_gemm_config(rows, n, k), tma=False)
    found = [now, replace(now, tma=True)]
    if not quick:
        found += [replace(now, block_n=bn, block_k=bk, split_k=split, tma=True)
                  for bn in (32, 64, 128) for bk in (128, 256) for split in (1, 2, 4) if bn * bk <= 128 * 256]
    return list(dict.fromkeys(found))


def product(x: torch.Tensor, q, cfg: Fp8GemmConfig | None):
    xq, s = act_quant_fp8_triton(x)
    return fp8_gemm_triton(xq, s, q.qweight, q.scale, torch.bfloat16, config=cfg)


def sweep_shape(out: list[Timing], shape: tuple[str, int, int], rows: int, quick: bool = False) -> None:
    """cuBLAS bf16, the scaled product, the quantization alone, then each candidate."""
    name, n, k = shape
    w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    fp8 = copies(quantize(w16, "fp8"))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = product(x, fp8[0], None).float()
    for cfg in candidates(rows, n, k, quick):
        record(out, shape, rows, PATH, cfg.label(), [lambda q=q, c=cfg: product(x, q, c) for q in fp8], 1)
        try:
            err = float((product(x, fp8[0], cfg).float() - want).norm() / want.norm())
        except Exception:  # noqa: BLE001  # logged by record already
            continue
        if err > 4e-3:
            logger.warning("%s %s differs from the chosen config's product: rel %.2e", name, cfg.label(), err)

    def scaled(q):
        xq, s = act_quant_fp8_triton(x)
        return torch._scaled_mm(xq, q.qweight.t(), scale_a=s, scale_b=q.scale[None, :], out_dtype=torch.bfloat16)
    record(out, shape, rows, "scaled_mm+triton quant", "", [lambda q=q: scaled(q) for q in fp8], 1)
    record(out, shape, rows, "act quant triton", "", [lambda: act_quant_fp8_triton(x)], 0)
    del fp8
    bf16 = copies(w16)
    record(out, shape, rows, "bf16 F.linear", "cublas", [lambda w=w: F.linear(x, w) for w in bf16], 2)
    del bf16, w16
    torch.cuda.empty_cache()


def fastest(out: list[Timing], name: str, rows: int) -> Timing | None:
    here = [t for t in out if t.shape == name and t.rows == rows and t.path == PATH]
    return min(here, key=lambda t: t.us) if here else None


def parse_label(label: str) -> Fp8GemmConfig:
    """A config from its :meth:`Fp8GemmConfig.label`."""
    parts = label.split()
    bm, bn, bk = (int(v) for v in parts[0].split("x"))
    opts = {p[0]: int(p[1:].rstrip("L")) for p in parts[1:] if p[0] in "kwsp" and p[1:].rstrip("L").isdigit()}
    lines = any(p[0] == "p" and p.endswith("L") for p in parts[1:])
    return Fp8GemmConfig(bm, bn, bk, opts["k"], opts["w"], opts["s"], opts.get("p", 0), lines, "tma" in parts)


def layer_chain(out: list[Timing], rows: int, picks: dict[str, Fp8GemmConfig | None], label: str,
                layers: list[dict]) -> float:
    """A layer's four products (each after its quantization) over the layer copies in one graph."""
    dims = {name: (n, k) for name, n, k in SHAPES}
    xs = {name: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in dims.items()}

    def step(layer):
        for name in ("qkv", "o", "gate_up", "down"):
            product(xs[name], layer[name], picks.get(name))
    us = graph_us([lambda w=w: step(w) for w in layers])
    moved = sum(n * k for n, k in dims.values())
    out.append(Timing("layer", rows, "fp8 gemm chain", label, us, moved / us / 1e3, 0.0))
    print(f"layer    rows {rows:3d} chain {label:40s} {us:9.2f} us {moved / us / 1e3:7.0f} GB/s", flush=True)
    return us


def report(out: list[Timing], rows: int) -> list[str]:
    """Per shape: the chosen config, the fastest, _scaled_mm and bf16 (us, TB/s); a layer's sums."""
    print(f"\n{'shape':8s} {'now us':>8s} {'best us':>8s} {'TB/s':>6s} {'best/now':>8s} {'scaled':>8s} "
          f"{'bf16':>8s}  best")
    sums = {"now": 0.0, "best": 0.0, "scaled": 0.0, "bf16": 0.0}
    winners = []
    for name, n, k in SHAPES:
        here = {t.config if t.path == PATH else t.path: t for t in out if t.shape == name and t.rows == rows}
        now = here.get(fp8_gemm_config(rows, n, k).label())
        top = fastest(out, name, rows)
        scaled, bf16 = here.get("scaled_mm+triton quant"), here.get("bf16 F.linear")
        if not (now and top):
            continue
        row = {"now": now.us, "best": top.us, "scaled": scaled.us if scaled else 0.0, "bf16": bf16.us if bf16 else 0.0}
        for key in sums:
            sums[key] += row[key]
        print(f"{name:8s} {now.us:8.2f} {top.us:8.2f} {n * k / top.us / 1e6:6.2f} {top.us / now.us:8.3f} "
              f"{row['scaled']:8.2f} {row['bf16']:8.2f}  {top.config}")
        cfg = parse_label(top.config)
        winners.append(f"({next_pow2(rows)}, {n}, {k}): Fp8GemmConfig({cfg.block_m}, {cfg.block_n}, {cfg.block_k}, "
                       f"{cfg.split_k}, {cfg.num_warps}, {cfg.num_stages}"
                       f"{', tma=True' if cfg.tma else ''}),  # {name} {top.us:.2f} us")
    print(f"{'layer':8s} {sums['now']:8.2f} {sums['best']:8.2f} {'':6s} {sums['best'] / max(sums['now'], 1e-9):8.3f} "
          f"{sums['scaled']:8.2f} {sums['bf16']:8.2f}  (sums of the four)")
    for t in out:
        if t.shape == "layer" and t.rows == rows:
            print(f"layer chain {t.config:40s} {t.us:8.2f} us")
    print("winners:\n    " + "\n    ".join(winners))
    return winners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--shapes", default=",".join(ORDER))
    parser.add_argument("--quick", action="store_true", help="the chosen tiles by pointers and by descriptor only")
    parser.add_argument("--no-chain", action="store_true", help="no layer chain")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    path = args.json or (Path(os.environ["OUT"]) / "fp8_gemm_sweep.json" if os.environ.get("OUT") else None)
    out: list[Timing] = []
    dims = {name: (name, n, k) for name, n, k in SHAPES}
    for name in args.shapes.split(","):
        sweep_shape(out, dims[name], args.rows, args.quick)
        if path is not None:
            path.write_text(json.dumps({"partial": True, "timings": [asdict(t) for t in out]}))
    if not args.no_chain:
        chains(out, args.rows)
    winners = report(out, args.rows)
    if path is not None:
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": args.rows,
                                    "timings": [asdict(t) for t in out], "winners": winners}, indent=1))
        print(f"wrote {path}")


def chains(out: list[Timing], rows: int) -> None:
    """A layer's four products in turn: the chosen configs, then this run's fastest."""
    layers = [{name: quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), "fp8")
               for name, n, k in SHAPES} for _ in range(2)]
    layer_chain(out, rows, {}, "chosen now", layers)
    best = {name: parse_label(t.config) for name, *_ in SHAPES if (t := fastest(out, name, rows))}
    layer_chain(out, rows, best, "fastest here", layers)


if __name__ == "__main__":
    main()
