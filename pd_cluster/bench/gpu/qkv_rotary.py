"""A decode layer's qkv projection with its rotary embedding and KV store on Llama-3-8B's shape,
as the layer runs it now against the projection then the rotary kernel, bf16 beside.

9 to 64 rows on float8 weights: the norm's quantizing kernel, then the FP8 GEMM that rotates and
stores in its epilogue
(:func:`pd_cluster.model.fp8_fused.norm_qkv_rotary_fp8`) against the GEMM then the rotary kernel,
with a bf16 KV cache and an fp8 one (there the GEMM rotates and the quantizing store follows).
Each path is timed in a CUDA graph over weight copies past L2 (:func:`fp8_sweep.graph_us`), and
its q and KV slots compared with the unfused path's on the same inputs (``diff``: elements that
differ, expected 0). The JSON goes to ``$OUT/qkv_rotary.json`` (``--json`` elsewhere).

    python -m pd_cluster.bench.gpu.qkv_rotary [--rows 16,32,64] [--kv none,fp8_e4m3]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kernels
from kernels.kv_quant import row_bytes
from kernels.qkv_epilogue import QkvRotary
from pd_cluster.bench.gpu.fp8_sweep import copies, graph_us
from pd_cluster.model.fp8_fused import norm_qkv_rotary_fp8, norm_then_linear
from pd_cluster.model.quant_linear import quantize

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
SLOTS = 1 << 15
EPS = 1e-5


@dataclass
class Result:
    rows: int
    kv: str
    path: str
    us: float
    diff: int | None = None


@dataclass
class Inputs:
    hidden: torch.Tensor
    residual: torch.Tensor
    norm: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def make(cls, rows: int, gen: torch.Generator) -> Inputs:
        dev = "cuda"
        cos, sin = kernels.rotary_cos_sin(HEAD_DIM, 8192, 500000.0, None, dev)
        return cls(torch.randn(rows, HIDDEN, device=dev, generator=gen).to(torch.bfloat16),
                   torch.randn(rows, HIDDEN, device=dev, generator=gen).to(torch.bfloat16),
                   (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=gen)).to(torch.bfloat16),
                   torch.randint(0, 8192, (rows,), device=dev, generator=gen),
                   torch.randperm(SLOTS, device=dev, generator=gen)[:rows], cos, sin)


def caches(quant: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if quant is None:
        return tuple(torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return tuple(torch.zeros(SLOTS, KV_HEADS, row_bytes(HEAD_DIM), dtype=torch.uint8, device="cuda") for _ in range(2))


def unfused(x: Inputs, w, kv, quant: str | None) -> torch.Tensor:
    """The projection (norm folded in where the layer folds it), then ``rotary_store_kv``."""
    rows = x.hidden.shape[0]
    qkv, _ = norm_then_linear(x.hidden, x.residual, x.norm, EPS, w)
    q, k, v = qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
    return kernels.rotary_store_kv(q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM),
                                   v.view(rows, KV_HEADS, HEAD_DIM), x.positions, x.cos, x.sin, *kv, x.slots, quant)


def fused(x: Inputs, w, kv, quant: str | None) -> torch.Tensor:
    """The GEMM's epilogue at 9-64 rows on float8 (what the layer runs)."""
    rows = x.hidden.shape[0]
    rotary = QkvRotary(x.positions, x.cos, x.sin, HEADS, KV_HEADS, HEAD_DIM, *kv, x.slots)
    done = norm_qkv_rotary_fp8(x.hidden, x.residual, x.norm, EPS, w, None, rotary, quant)
    if done is None:
        raise RuntimeError(f"the FP8 GEMM does not serve {rows} rows here")
    return done[0]


def differing(x: Inputs, w, quant: str | None) -> int:
    """Elements of q and of the written KV slots where the fused path and the unfused one differ."""
    a, b = caches(quant), caches(quant)
    qa, qb = fused(x, w, a, quant), unfused(x, w, b, quant)
    count = int((qa.float() != qb.float()).sum())
    for ca, cb in zip(a, b):
        count += int((ca[x.slots] != cb[x.slots]).sum())
    return count


def run(rows_list: list[int], kvs: list[str | None], out: list[Result]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5
    weights = {"bf16": copies(dense.to(torch.bfloat16)), "fp8": copies(quantize(dense, "fp8"))}
    del dense
    for rows in rows_list:
        if rows <= 8:
            raise SystemExit(f"{rows} rows: the FP8 GEMM's epilogue serves 9-64 (fewer take the one-row GEMVs)")
        x = Inputs.make(rows, gen)
        for quant in kvs:
            kv = caches(quant)
            label = quant or "bf16"
            base = [lambda w=w: unfused(x, w, kv, quant) for w in weights["bf16"]]
            report(out, Result(rows, label, "bf16 (as the layer runs)", graph_us(base)))
            ws = weights["fp8"]
            report(out, Result(rows, label, "fp8 before", graph_us([lambda w=w: unfused(x, w, kv, quant)
                                                                   for w in ws])))
            report(out, Result(rows, label, "fp8 now", graph_us([lambda w=w: fused(x, w, kv, quant) for w in ws]),
                               differing(x, ws[0], quant)))


def report(out: list[Result], r: Result) -> None:
    out.append(r)
    diff = "" if r.diff is None else f"  diff {r.diff}"
    print(f"rows {r.rows:3d} kv {r.kv:9s} {r.path:26s} {r.us:8.2f} us{diff}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,16,32")
    parser.add_argument("--kv", default="none,fp8_e4m3")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "qkv_rotary.json")
    args = parser.parse_args()
    out: list[Result] = []
    try:
        run([int(r) for r in args.rows.split(",")], [None if k == "none" else k for k in args.kv.split(",")], out)
    finally:
        args.json.write_text(json.dumps([asdict(r) for r in out], indent=1))
    print("\nrows kv        path                       us     vs before  vs bf16")
    for r in out:
        before = next((b.us for b in out if (b.rows, b.kv, b.path) == (r.rows, r.kv, r.path.replace("now", "before"))),
                      None)
        bf16 = next(b.us for b in out if (b.rows, b.kv) == (r.rows, r.kv) and b.path.startswith("bf16"))
        print(f"{r.rows:4d} {r.kv:9s} {r.path:26s} {r.us:7.2f}  {r.us / before if before else 1:8.3f}  "
              f"{r.us / bf16:7.3f}")


if __name__ == "__main__":
    main()
